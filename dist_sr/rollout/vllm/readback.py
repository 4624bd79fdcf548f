"""What a vLLM worker's parameters hold, read back as the checkpoint's (Hugging Face) tensors.

A loaded tensor reaches a parameter through the model's own name mapping (``hf_to_vllm_mapper``,
or ``packed_modules_mapping``: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``) and the
parameter's own ``weight_loader``, which takes this worker's tensor-parallel slice and writes it
at its place in a fused parameter. To learn that placement without trusting it, the loader is run
once per (tensor, parameter) on probes, and what it writes where is recorded (``trace``):

- **by address** (any size, no memory): the parameter's storage is swapped for an uninitialised
  byte tensor of its shape, and the tensor for another of its own shape; both are address space
  only (never written, so the OS backs them with no memory). Under a dispatch mode every view the
  loader takes of them (``narrow``, slicing, ``select``, transposes) runs as usual, so the
  strides and offsets of what it finally copies say which tensor elements land where; the copies
  and fills themselves are recorded and not run.
- **by index probe** (a loader that computes on the values: ``index_put_``, a cast, a
  concatenation): the parameter's storage swapped for a tensor of -1, the tensor replaced by its
  element indices plus one (int64; 0 stays free for padding a loader zero-fills); wherever the
  probe then holds ``i + 1``, the parameter holds element ``i``. This costs 24 bytes per element,
  so it is only done where that fits in the read-back's chunk (``chunk_bytes``); a larger tensor
  whose loader cannot be traced by address is named as unreadable.

The placement is kept as ``Block``s (rows of a strided slice: a tensor-parallel column slice is
one block, not one run per row); reading back is then the layout-free digest
(``numerics.digest``) of those rows of the live parameter, with the tensor's global indices,
where the parameter lives (the compiled digest on the host, torch on a device). A parameter
stored in another dtype than it was loaded in is narrowed chunk by chunk. So the read-back's extra
memory is at most ``chunk_bytes`` (256 MiB by default, ``DIST_SR_READBACK_CHUNK_MB``), whatever
the tensor's size.

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
import itertools
import os
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ...numerics.digest import MASK64, piece_sums

CHUNK_ENV = "DIST_SR_READBACK_CHUNK_MB"
MAX_BLOCKS = 1 << 16  # rows of a placement beyond which a loader's writes are not kept by address


def chunk_bytes() -> int:
    """The most extra memory a read-back may take (``DIST_SR_READBACK_CHUNK_MB``, default 256)."""
    raw = os.environ.get(CHUNK_ENV, "").strip() or "256"
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if mb <= 0:
        raise ValueError(f"{CHUNK_ENV}={raw!r}: say the read-back's chunk in MiB, a positive number (default 256)")
    return int(mb * (1 << 20))


@dataclass(frozen=True)
class Block:
    """``count`` rows of ``length`` elements: row k is elements ``[param_start + k * param_step,
    ... + length)`` of the flat parameter, holding elements ``[tensor_start + k * tensor_step, ...
    + length)`` of the flat loaded tensor."""

    param_start: int
    tensor_start: int
    length: int
    count: int = 1
    param_step: int = 0
    tensor_step: int = 0

    @property
    def covered(self) -> int:
        return self.length * self.count


@dataclass(frozen=True)
class Placement:
    """Where one loaded tensor lives in this worker's parameter ``param``."""

    param: str
    blocks: tuple[Block, ...]

    @property
    def covered(self) -> int:
        return sum(b.covered for b in self.blocks)

    def signature(self) -> str:
        """Which tensor elements this worker holds (equal for replicas, whatever the param layout)."""
        return hashlib.sha256(repr(_tensor_side(self.blocks)).encode()).hexdigest()[:16]


def _tensor_side(blocks: tuple[Block, ...]) -> list[tuple[int, int, int, int]]:
    """The tensor elements ``blocks`` cover, in one canonical form: ``(start, length, count,
    step)``, rows that follow each other as one run, runs that touch merged."""
    rows = []
    for b in blocks:
        if b.count == 1 or b.tensor_step == b.length:
            rows.append((b.tensor_start, b.covered, 1, 0))
        else:
            rows.append((b.tensor_start, b.length, b.count, b.tensor_step))
    rows.sort()
    out: list[tuple[int, int, int, int]] = []
    for r in rows:
        if out and out[-1][2] == 1 and r[2] == 1 and out[-1][0] + out[-1][1] == r[0]:
            out[-1] = (out[-1][0], out[-1][1] + r[1], 1, 0)
        else:
            out.append(r)
    return out


class Unreadable(Exception):
    """Why a loaded tensor cannot be read back from this worker's parameters."""


class _Untraceable(Exception):
    """The loader did something to its probes that tracing by address cannot follow."""


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


def trace(param: torch.nn.Parameter, shape: tuple[int, ...], shard, *, budget: int | None = None) -> tuple[Block, ...]:
    """Run ``param``'s own weight loader on probes: where each element of a tensor of ``shape``
    lands in ``param`` on this worker, as blocks. By address where the loader only takes views
    and copies (any size, no memory); else by index probe where that fits in ``budget`` bytes
    (default ``chunk_bytes()``). The parameter's storage is swapped out for the call and restored."""
    if param.is_meta:
        raise Unreadable("a weight update is in progress (the parameter is being reloaded)")
    if param.numel() == 0:
        raise Unreadable("the backend repacked this parameter and left it empty")
    loader = getattr(param, "weight_loader", None)
    while getattr(loader, "__name__", "") == "online_process_loader":  # vLLM's layerwise reload wraps it
        loader = loader.__wrapped__
    if loader is None:
        loader = _default_loader()
    try:
        return _by_address(param, loader, shape, shard)
    except _Untraceable as why:
        cost = 24 * (param.numel() + _numel(shape))
        limit = chunk_bytes() if budget is None else budget
        if cost > limit:
            raise Unreadable(
                f"its weight loader computes on the values ({why}), and tracing it by index probe would take "
                f"{cost / 2**20:.0f} MiB, over the read-back's chunk of {limit / 2**20:.0f} MiB ({CHUNK_ENV})"
            ) from None
    return _by_index_probe(param, loader, shape, shard)


def _call(param, loader, probe: torch.Tensor, source: torch.Tensor, shard, mode=None) -> torch.Tensor:
    saved, grad = param.data, param.requires_grad
    try:
        param.requires_grad_(False)  # an integer probe cannot stand in for a parameter that requires grad
        param.data = probe
        if mode is None:
            loader(param, source) if shard is None else loader(param, source, shard)
        else:
            with mode:
                loader(param, source) if shard is None else loader(param, source, shard)
        return param.data
    except _Untraceable:
        raise
    except Exception as exc:
        raise Unreadable(f"its weight loader does not run on a probe ({type(exc).__name__}: {exc})") from None
    finally:
        param.data = saved
        param.requires_grad_(grad)


def _by_address(param, loader, shape, shard) -> tuple[Block, ...]:
    probe = torch.empty(tuple(param.shape), dtype=torch.uint8)  # address space: never written
    source = torch.empty(tuple(shape), dtype=torch.uint8)
    recorder = _Recorder(probe, source)
    _call(param, loader, probe, source, shard, recorder)
    return recorder.blocks()


class _Recorder(TorchDispatchMode):
    """Lets the loader take views of the probes, records its copies and fills into the parameter
    probe (never running them), and stops at anything else that touches a probe."""

    _WRITES = {
        torch.ops.aten.copy_.default,
        torch.ops.aten.fill_.Scalar,
        torch.ops.aten.fill_.Tensor,
        torch.ops.aten.zero_.default,
    }

    def __init__(self, probe: torch.Tensor, source: torch.Tensor):
        super().__init__()
        self.probe_at, self.source_at = _base(probe), _base(source)
        self.writes: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (into the probe, from the source or None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        touched = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and self._ours(t)]
        if not touched or getattr(func, "is_view", False):
            return func(*args, **kwargs)
        if func in self._WRITES and isinstance(args[0], torch.Tensor) and _base(args[0]) == self.probe_at:
            src = args[1] if func is torch.ops.aten.copy_.default else None
            if isinstance(src, torch.Tensor) and _base(src) == self.probe_at:
                raise _Untraceable("it copies the parameter into itself")
            from_source = isinstance(src, torch.Tensor) and _base(src) == self.source_at
            self.writes.append((args[0], src.expand_as(args[0]) if from_source else None))
            return args[0]
        raise _Untraceable(f"it runs {func} on the weights")

    def _ours(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and _base(t) in (self.probe_at, self.source_at)

    def blocks(self) -> tuple[Block, ...]:
        hulls = [_hull(dst) for dst, _ in self.writes if dst.numel()]
        hulls.sort()
        if any(a[1] >= b[0] for a, b in zip(hulls, hulls[1:])):
            raise _Untraceable("its writes overlap")
        out: list[Block] = []
        for dst, src in self.writes:
            if src is not None:
                out.extend(_copy_blocks(dst, src))
        return tuple(sorted(out, key=lambda b: b.param_start))


def _base(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _hull(view: torch.Tensor) -> tuple[int, int]:
    """The first and last flat positions of the base that ``view`` touches."""
    last = view.storage_offset() + sum((n - 1) * s for n, s in zip(view.shape, view.stride()))
    return view.storage_offset(), last


def _copy_blocks(dst: torch.Tensor, src: torch.Tensor) -> list[Block]:
    """The blocks of ``dst.copy_(src)``, both views of flat bases: dimensions merged where both
    sides are contiguous across them, the innermost contiguous dimension as the rows' length."""
    if dst.numel() == 0:
        return []
    dims = [(n, a, b) for n, a, b in zip(dst.shape, dst.stride(), src.stride()) if n != 1]
    if any(b == 0 for _, _, b in dims):
        raise _Untraceable("it broadcasts one element of the tensor to several places")
    merged: list[tuple[int, int, int]] = []
    for n, a, b in reversed(dims):  # innermost first
        if merged and a == merged[-1][0] * merged[-1][1] and b == merged[-1][0] * merged[-1][2]:
            m = merged.pop()
            merged.append((m[0] * n, m[1], m[2]))
        else:
            merged.append((n, a, b))
    merged.reverse()  # outermost first again
    length = 1
    if merged and merged[-1][1] == 1 and merged[-1][2] == 1:
        length = merged.pop()[0]
    rows = merged.pop() if merged else (1, 0, 0)
    outer = merged
    total = rows[0]
    for n, _, _ in outer:
        total *= n
    if total > MAX_BLOCKS:
        raise _Untraceable(f"it scatters the tensor into {total} pieces")
    out = []
    for idx in itertools.product(*(range(n) for n, _, _ in outer)):
        p0 = dst.storage_offset() + sum(i * a for i, (_, a, _) in zip(idx, outer))
        t0 = src.storage_offset() + sum(i * b for i, (_, _, b) in zip(idx, outer))
        out.append(Block(p0, t0, length, rows[0], rows[1] if rows[0] > 1 else 0, rows[2] if rows[0] > 1 else 0))
    return out


def _by_index_probe(param, loader, shape, shard) -> tuple[Block, ...]:
    probe = torch.full(tuple(param.shape), -1, dtype=torch.int64)
    source = torch.arange(1, _numel(shape) + 1, dtype=torch.int64).view(shape)
    placed = _call(param, loader, probe, source, shard)
    return _runs(placed.reshape(-1) - 1)


def _default_loader():
    """vLLM's loader for parameters without their own (a plain copy of the whole tensor)."""
    try:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    except ImportError:  # a model built outside vLLM (the tests of this module)
        return lambda param, loaded: param.data.copy_(loaded)
    return default_weight_loader


def _runs(indices: torch.Tensor) -> tuple[Block, ...]:
    """Maximal runs of consecutive positions holding consecutive indices (negative: no element)."""
    pos = torch.nonzero(indices >= 0).reshape(-1)
    if pos.numel() == 0:
        return ()
    idx = indices[pos]
    breaks = torch.nonzero((pos[1:] != pos[:-1] + 1) | (idx[1:] != idx[:-1] + 1)).reshape(-1) + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([pos.numel()])])
    return tuple(Block(int(pos[s]), int(idx[s]), int(e - s)) for s, e in zip(starts.tolist(), ends.tolist()))


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
            if isinstance(known, Placement) and not known.blocks:
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
        budget = chunk_bytes()
        readable, unreadable = {}, {}
        views: list[tuple[torch.Tensor, int, int]] = []  # digested together: one read-back per device
        for name, (dtype, shape, _) in loaded.items():
            try:
                where = self.placement(model, params, name, shape)
                flat = params[where.param].detach().reshape(-1)
                first, narrowed = len(views), 0
                for piece, is_view in _pieces(flat, where.blocks, getattr(torch, dtype), budget):
                    if is_view:
                        views.append(piece)
                    else:  # a narrowed copy: digested now, so at most one is held at a time
                        narrowed += piece_sums([piece])[0]
            except Unreadable as why:
                unreadable[name] = str(why)
                continue
            readable[name] = (dtype, shape, where, first, len(views), narrowed)
        sums = piece_sums(views)
        out = {}
        for name, (dtype, shape, where, first, end, narrowed) in readable.items():
            total = (sum(sums[first:end]) + narrowed) & MASK64
            out[name] = [dtype, list(shape), f"{total:016x}", where.covered, where.signature()]
        return {"readback": out, "unreadable": unreadable}


def _pieces(flat: torch.Tensor, blocks: tuple[Block, ...], dtype: torch.dtype, budget: int):
    """``((rows, first index, row step), is a view)``: the digest pieces of ``blocks`` of ``flat``, in the dtype the
    tensor was loaded in: views of the parameter, or, where the backend keeps it in another dtype
    (a BF16 bias kept in FP32), narrowed copies of at most ``budget // 4`` bytes of the parameter
    at a time, checked to convert back exactly (one whose values do not is unreadable)."""
    if flat.dtype != dtype and not flat.is_floating_point():
        raise Unreadable(f"the parameter holds {_name(flat.dtype)}, not a float")
    step = max(1, (budget // 4) // flat.element_size())  # parameter elements narrowed at a time
    for b in blocks:
        rows = flat.as_strided((b.count, b.length), (b.param_step, 1), flat.storage_offset() + b.param_start)
        if flat.dtype == dtype:
            yield (rows, b.tensor_start, b.tensor_step), True
            continue
        per, width = max(1, step // b.length), min(b.length, step)  # rows, and columns of a row, at a time
        for r0 in range(0, b.count, per):
            for c0 in range(0, b.length, width):
                part = rows[r0 : r0 + per, c0 : c0 + width]
                narrowed = part.to(dtype)
                if not torch.equal(narrowed.to(flat.dtype), part):
                    raise Unreadable(
                        f"the parameter holds {_name(flat.dtype)} values that are not {_name(dtype)} values"
                    )
                yield (narrowed, b.tensor_start + r0 * b.tensor_step + c0, b.tensor_step), False


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
