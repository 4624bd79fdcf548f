"""What a vLLM worker's parameters hold, read back as the checkpoint's (Hugging Face) tensors.

A loaded tensor reaches a parameter through the model's own name mapping (``hf_to_vllm_mapper``,
or ``packed_modules_mapping``: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``) and the
parameter's own ``weight_loader``, which takes this worker's tensor-parallel slice and writes it
at its place in a fused parameter. To learn that placement without trusting it, the loader is run
once per (tensor, parameter) on a probe: the parameter's storage swapped for a CPU tensor of -1,
the tensor replaced by its element indices plus one (int64, exact at any size; 0 stays free for
the padding a loader zero-fills). Wherever the probe then holds ``i + 1``, the parameter holds
element ``i`` of the tensor. The placement is kept as
runs (parameter range -> tensor range); reading back is then the layout-free digest
(``numerics.digest``) of those ranges of the live parameter, with the tensor's global indices.

Each worker reports, per tensor, its partial digest, how many elements it covers and a signature
of which; workers whose coverage is identical are replicas (a replicated norm, a K/V head on
several ranks) and must agree, and disjoint coverages add up (``combine_readbacks``). So a
tensor-parallel loader that takes the wrong slice shows up as elements no worker holds, and a
load that dropped or changed a tensor as a digest that is not the one sent.

Not readable: a parameter the backend emptied after repacking it (vLLM's CPU backend hands its
linear weights to oneDNN), one in another dtype that does not convert back exactly, a name the
model maps to no parameter of this worker (a pipeline stage without that layer, a model with its
own mapping), a loader that fails on the probe. Those tensors are verified only as they were
handed to ``load_weights`` (``held.LoadRecord``), and the report names them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ...numerics.digest import MASK64, piece_sums


@dataclass(frozen=True)
class Run:
    """Elements ``[param_start, param_start + length)`` of the flat parameter hold elements
    ``[tensor_start, tensor_start + length)`` of the flat loaded tensor."""

    param_start: int
    tensor_start: int
    length: int


@dataclass(frozen=True)
class Placement:
    """Where one loaded tensor lives in this worker's parameter ``param``."""

    param: str
    runs: tuple[Run, ...]

    @property
    def covered(self) -> int:
        return sum(r.length for r in self.runs)

    def signature(self) -> str:
        """Which tensor elements this worker holds (equal for replicas, whatever the param layout)."""
        spans = sorted((r.tensor_start, r.length) for r in self.runs)
        return hashlib.sha256(repr(spans).encode()).hexdigest()[:16]


class Unreadable(Exception):
    """Why a loaded tensor cannot be read back from this worker's parameters."""


def target(model: torch.nn.Module, params: dict, name: str) -> tuple[str, object]:
    """``(parameter name, shard id or None)`` the model loads tensor ``name`` into."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    with_shard = getattr(mapper, "_map_name_with_shard", None)
    if with_shard is not None:
        mapped = with_shard(name)
        if mapped is None:
            raise Unreadable("the model's name mapping drops it")
        pname, shard = mapped
        if pname in params and (shard is None or isinstance(shard, (str, int))):
            return pname, shard
    if name in params:
        return name, None
    for packed, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
        for i, part in enumerate(parts):
            marker = f".{part}."
            if marker not in f".{name}":
                continue
            pname = f".{name}".replace(marker, f".{packed}.", 1)[1:]
            if pname in params:
                qkv = list(parts) == ["q_proj", "k_proj", "v_proj"]
                return pname, ("q", "k", "v")[i] if qkv else i
    raise Unreadable("no parameter of this worker is loaded from it")


def trace(param: torch.nn.Parameter, shape: tuple[int, ...], shard) -> tuple[Run, ...]:
    """Run ``param``'s own weight loader on index probes: where each element of a tensor of
    ``shape`` lands in ``param`` on this worker, as runs. The parameter's storage is swapped out
    for the call and restored."""
    if param.is_meta:
        raise Unreadable("a weight update is in progress (the parameter is being reloaded)")
    if param.numel() == 0:
        raise Unreadable("the backend repacked this parameter and left it empty")
    loader = getattr(param, "weight_loader", None)
    while getattr(loader, "__name__", "") == "online_process_loader":  # vLLM's layerwise reload wraps it
        loader = loader.__wrapped__
    if loader is None:
        loader = _default_loader()
    saved, grad = param.data, param.requires_grad
    probe = torch.full(tuple(param.shape), -1, dtype=torch.int64)
    source = torch.arange(1, _numel(shape) + 1, dtype=torch.int64).view(shape)
    try:
        param.requires_grad_(False)  # an integer probe cannot stand in for a parameter that requires grad
        param.data = probe
        loader(param, source) if shard is None else loader(param, source, shard)
        placed = param.data
    except Exception as exc:
        raise Unreadable(f"its weight loader does not run on a probe ({type(exc).__name__}: {exc})") from None
    finally:
        param.data = saved
        param.requires_grad_(grad)
    return _runs(placed.reshape(-1) - 1)


def _default_loader():
    """vLLM's loader for parameters without their own (a plain copy of the whole tensor)."""
    try:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    except ImportError:  # a model built outside vLLM (the tests of this module)
        return lambda param, loaded: param.data.copy_(loaded)
    return default_weight_loader


def _runs(indices: torch.Tensor) -> tuple[Run, ...]:
    """Maximal runs of consecutive positions holding consecutive indices (negative: no element)."""
    pos = torch.nonzero(indices >= 0).reshape(-1)
    if pos.numel() == 0:
        return ()
    idx = indices[pos]
    breaks = torch.nonzero((pos[1:] != pos[:-1] + 1) | (idx[1:] != idx[:-1] + 1)).reshape(-1) + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([pos.numel()])])
    return tuple(Run(int(pos[s]), int(idx[s]), int(e - s)) for s, e in zip(starts.tolist(), ends.tolist()))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class Readback:
    """The placements of one model's loaded tensors (traced once per tensor, name and shape) and
    the digests of what the parameters hold there now."""

    def __init__(self):
        self.placements: dict[tuple[str, tuple[int, ...]], Placement | str] = {}

    def placement(self, model: torch.nn.Module, params: dict, name: str, shape: tuple[int, ...]) -> Placement:
        key = (name, tuple(shape))
        known = self.placements.get(key)
        if known is None:
            try:
                pname, shard = target(model, params, name)
                known = Placement(pname, trace(params[pname], tuple(shape), shard))
            except Unreadable as why:
                known = str(why)
            if isinstance(known, Placement) and not known.runs:
                known = "its weight loader places no element of it on this worker"
            self.placements[key] = known
        if isinstance(known, str):
            raise Unreadable(known)
        live = params[known.param]
        if live.numel() == 0:  # repacked since it was traced (a reload)
            raise Unreadable("the backend repacked this parameter and left it empty")
        if live.is_meta:
            raise Unreadable("a weight update is in progress (the parameter is being reloaded)")
        return known

    @torch.no_grad()
    def report(self, model: torch.nn.Module, loaded: dict[str, tuple[str, tuple[int, ...], int]]) -> dict:
        """For each tensor in ``loaded`` (``LoadRecord.entries``: name -> (dtype, shape, sum)):
        ``{"readback": {name: [dtype, shape, hex partial sum, covered, signature]},
        "unreadable": {name: why}}``."""
        params = dict(model.named_parameters())
        readable, unreadable = {}, {}
        for name, (dtype, shape, _) in loaded.items():
            try:
                where = self.placement(model, params, name, shape)
                flat = _as_loaded(params[where.param].detach().reshape(-1), dtype)
            except Unreadable as why:
                unreadable[name] = str(why)
                continue
            readable[name] = (dtype, shape, where, flat)
        pieces = [
            (flat[r.param_start : r.param_start + r.length], r.tensor_start)
            for _, _, where, flat in readable.values()
            for r in where.runs
        ]
        sums = iter(piece_sums(pieces))
        out = {}
        for name, (dtype, shape, where, _) in readable.items():
            total = 0
            for _ in where.runs:
                total = (total + next(sums)) & MASK64
            out[name] = [dtype, list(shape), f"{total:016x}", where.covered, where.signature()]
        return {"readback": out, "unreadable": unreadable}


def _as_loaded(flat: torch.Tensor, dtype: str) -> torch.Tensor:
    """The parameter's values in the dtype they were loaded in: a backend that widened them (a
    BF16 bias kept in FP32) is read back exactly, one whose values do not convert back is not."""
    want = getattr(torch, dtype)
    if flat.dtype == want:
        return flat
    if not flat.is_floating_point():
        raise Unreadable(f"the parameter holds {flat.dtype}, not a float")
    narrowed = flat.to(want)
    if not torch.equal(narrowed.to(flat.dtype), flat):
        raise Unreadable(f"the parameter holds {flat.dtype} values that are not {dtype} values")
    return narrowed


@dataclass(frozen=True)
class Held:
    """One tensor as the workers of one engine hold it, read back and combined."""

    sum: int | None  # the layout-free digest sum of the elements held (None: not readable anywhere)
    covered: int  # distinct elements held by some worker
    numel: int
    problem: str | None = None  # replicas that disagree


def combine_readbacks(name: str, numel: int, parts: list[list]) -> Held:
    """Combine the workers' ``readback`` entries for ``name`` (``[dtype, shape, hex, covered,
    signature]`` each, from the workers that could read it): workers with the same coverage
    signature are replicas and must agree; distinct coverages are disjoint slices and add up."""
    groups: dict[str, tuple[int, int]] = {}
    for _, _, hex_sum, covered, signature in parts:
        s = int(hex_sum, 16)
        seen = groups.setdefault(signature, (s, int(covered)))
        if seen[0] != s:
            return Held(None, 0, numel, "workers holding the same elements hold different values")
    total = sum(s for s, _ in groups.values()) & MASK64
    return Held(total, sum(c for _, c in groups.values()), numel)
