"""Changed elements as (index, value) pairs: what the peers' delta syncs take.

vLLM's ``sparse_nccl`` weight-transfer engine (``SparseWeightPatch``: a checkpoint name, 1-D int32
flat indices into the full tensor, the new values, the full shape) and verl 0.9's
``delta_sharded`` checkpoint engine (int32 positions and BF16 values per tensor) both send every
changed element as a pair: 4 bytes of index and 2 of value. Both receivers build a full tensor of
NaN, scatter the values in and load it with a ``copy_`` that skips NaN, so a NaN *value* cannot be
sent as a change (vLLM refuses it).

Such a sync is a win only while few elements change: at round-to-nearest's or ``bf16-dither``'s
~0.8% per step it is ~1/40 of dense; at bf16-sr's ~26% it is ~0.8x dense (the grid-step code of
``numerics.delta``, which our own backend sends, is 1/12.7 there). ``SparseExport`` gives a
peer's trainer side these pairs for the weights dist-sr rounds, against the version the peer
last received (``delivered()``), exactly (bit comparison, so -0/+0 and NaN payloads count as
changes), and tells when a tensor is cheaper dense (``SparsePatch.worth_it``). The peers' sparse
paths check nothing, so each export also carries the digest of the version the peer holds after
it (``SparseSync.entries``; ``differing`` names the tensors a peer holds otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import collectives
from ...config import Refusal
from ...numerics.digest import combine, piece_sums, tensor_sums
from ...sources import add_rank_sums

INDEX_LIMIT = 2**31  # the peers' indices are int32


class SparseUnsupported(Refusal, ValueError):
    """A change the peers' sparse paths cannot carry (a NaN value, a tensor past int32 indices)."""

    what = "sparse sync refused"


@dataclass(frozen=True)
class SparsePatch:
    """The elements of ``name`` that changed, in checkpoint coordinates (vLLM's ``SparseWeightPatch``
    fields)."""

    name: str
    indices: torch.Tensor  # int32, 1-D, flat positions in the full tensor, ascending, unique
    values: torch.Tensor  # the new 16-bit values at those positions
    full_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes on the peers' wire: indices and values."""
        return self.indices.numel() * 4 + self.values.numel() * self.values.element_size()

    def worth_it(self) -> bool:
        """Whether the pairs are smaller than this piece sent dense (16-bit codes)."""
        dense = 2
        for s in self.full_shape:
            dense *= s
        return self.nbytes < dense


def sparse_patch(name: str, old: torch.Tensor, new: torch.Tensor, full_shape, start: int = 0) -> SparsePatch:
    """The elements of ``new`` whose bits differ from ``old`` (two 16-bit versions of the flat range
    ``[start, start + numel)`` of ``name``), as pairs in the full tensor's coordinates."""
    numel = 1
    for s in full_shape:
        numel *= s
    if numel >= INDEX_LIMIT:
        raise SparseUnsupported(f"{name}: {numel} elements do not fit the peers' int32 indices; sync this tensor dense")
    a, b = old.detach().reshape(-1), new.detach().reshape(-1)
    if a.element_size() != 2 or b.dtype != a.dtype or a.numel() != b.numel():
        raise SparseUnsupported(
            f"{name}: pairs are taken between two 16-bit versions of one size, not {a.dtype}/{b.dtype}"
        )
    local = torch.nonzero(a.view(torch.int16) != b.view(torch.int16)).reshape(-1)
    values = b[local]
    if bool(torch.isnan(values).any()):
        raise SparseUnsupported(
            f"{name}: a weight became NaN, which the peers' sparse loaders read as 'unchanged' "
            "(vLLM refuses it); sync this version dense, and look at the run: its weights diverged"
        )
    return SparsePatch(name, (local + start).to(torch.int32), values.clone(), tuple(full_shape))


@dataclass(frozen=True)
class SparseSync:
    """One export for a peer's sync: the pairs (None: this sync must be dense) and what the peer
    must hold once it applied them, as layout-free digest entries (``numerics.digest``:
    ``{name: (dtype, shape, sum)}``, summed over the trainer ranks) and their combined ``digest``.
    A peer checks itself with ``differing(sync.entries, its_tensors)``."""

    patches: list[SparsePatch] | None
    entries: dict[str, tuple[str, tuple[int, ...], int]]
    digest: str


def differing(entries: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of ``entries`` that ``tensors`` (full tensors by name, as a peer holds them) do not
    hold bit for bit, sorted: empty when the peer holds what the trainer exported."""
    held = tensor_sums({n: t for n, t in tensors.items() if n in entries})
    want = {n: (d, tuple(shape), int(v)) for n, (d, shape, v) in entries.items()}
    return sorted(n for n in want if held.get(n) != want[n])


class SparseExport:
    """The trainer side of a peer's delta sync. ``export()`` returns, for every tensor this rank
    holds a piece of, the elements that changed since the version the peer last received, and the
    digest of the version it holds after this sync; ``delivered()`` says the peer received the last
    export. The held copy (a host copy of this rank's 16-bit pieces) changes only then: an export
    that was refused, lost or never sent leaves it at the peer's version, so the next pairs are
    against what the peer holds. The first export, and the first after ``reset()`` or after a
    refusal (``SparseUnsupported`` on any rank: the message asks for a dense sync), has
    ``patches`` None. Every trainer rank of ``group`` calls ``export()`` (a collective: the digest
    adds up the ranks' pieces) and ``delivered()``."""

    def __init__(self, source, group=None):
        self.source, self.group = source, group
        self.world = collectives.world(group)
        self.held: dict[tuple[str, int], torch.Tensor] = {}  # the version the peer received, per piece
        self.exported = False  # whether ``held`` is a version the peer received
        self._pending: tuple[list, bool] | None = None  # the last export, until delivered

    def export(self) -> SparseSync:
        metas = self.source.metadata()
        shapes = {m[0]: tuple(m[2]) for m in metas}
        pieces = [p for p in self.source.local_pieces(list(shapes)) if p.end > p.start]
        dense = not collectives.all_true(self.exported and all(self._holds(p) for p in pieces), self.group)
        pending, problem = [], ""
        for p in pieces:
            bits, key = p.bits.detach().reshape(-1).cpu(), (p.name, p.start)
            try:
                pending.append(
                    (
                        key,
                        bits.clone() if dense else sparse_patch(p.name, self.held[key], bits, shapes[p.name], p.start),
                    )
                )
            except SparseUnsupported as exc:
                problem = problem or str(exc)
        problems = collectives.gathered(problem, self.group)
        if any(problems):
            self.reset()  # the peer takes this version dense: so does the next export
            raise SparseUnsupported(next(pr for pr in problems if pr))
        self._pending = pending, dense
        sums = dict(zip([p.name for p in pieces], piece_sums([(p.bits, p.start) for p in pieces])))
        entries = add_rank_sums(sums, metas, self.world, self.group)
        return SparseSync(None if dense else [patch for _, patch in pending], entries, combine(entries))

    def patches(self) -> list[SparsePatch] | None:
        """``export()``'s pairs for a caller that delivers every export it takes (``delivered()``
        implied; a refusal still leaves the held copies alone and makes the next call dense)."""
        sync = self.export()
        self.delivered()
        return sync.patches

    def _holds(self, p) -> bool:
        held = self.held.get((p.name, p.start))
        return held is not None and held.numel() == p.end - p.start and held.dtype == p.bits.dtype

    def delivered(self) -> None:
        """The peer received (and applied) the last ``export()``: it is the held version from now on."""
        if self._pending is None:
            raise RuntimeError(
                "SparseExport.delivered(): nothing exported since the last delivery; call export() first"
            )
        pending, dense = self._pending
        if dense:
            self.held = dict(pending)
        else:
            for (name, start), patch in pending:
                self.held[(name, start)].view(torch.int16)[patch.indices.long() - start] = patch.values.view(
                    torch.int16
                )
        self.exported, self._pending = True, None

    def reset(self) -> None:
        """After a sync the peer did not complete: the next ``export()`` is dense (None pairs)."""
        self.held, self.exported, self._pending = {}, False, None


def to_vllm(patches: list[SparsePatch]) -> list:
    """The patches as vLLM's ``SparseWeightPatch`` (its ``sparse_nccl`` trainer engine's
    ``send_weights``); refuses by name when the installed vLLM has no sparse engine."""
    try:
        from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch
    except ImportError as exc:
        raise SparseUnsupported(
            f"this vLLM has no sparse_nccl weight-transfer engine ({exc}); it arrived in vLLM 0.28: "
            "use the dist_sr backend's grid-step deltas (rollout.vllm.delta_sync) instead"
        ) from None
    return [SparseWeightPatch(p.name, p.indices, p.values, p.full_shape) for p in patches]
