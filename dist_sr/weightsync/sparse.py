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
peer's trainer side these pairs for the weights dist-sr rounds, against the version it last
exported, exactly (bit comparison, so -0/+0 and NaN payloads count as changes), and tells when a
tensor is cheaper dense (``SparsePatch.worth_it``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INDEX_LIMIT = 2**31  # the peers' indices are int32


class SparseUnsupported(ValueError):
    """A change the peers' sparse paths cannot carry (a NaN value, a tensor past int32 indices)."""


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


class SparseExport:
    """The trainer side of a peer's delta sync: ``patches()`` returns, for every tensor this rank
    holds a piece of, the elements that changed since the previous call (None on the first call
    and after ``reset()``: that sync must be dense). Keeps a host copy of this rank's 16-bit pieces."""

    def __init__(self, source):
        self.source = source
        self.held: dict[tuple[str, int], torch.Tensor] = {}
        self.exported = False  # whether ``held`` is a version the peer received

    def patches(self) -> list[SparsePatch] | None:
        metas = {m[0]: tuple(m[2]) for m in self.source.metadata()}
        first, self.exported = not self.exported, True
        out: list[SparsePatch] = []
        for p in self.source.local_pieces(list(metas)):
            if p.end <= p.start:
                continue
            bits = p.bits.detach().reshape(-1).cpu()
            key = (p.name, p.start)
            if not first:
                out.append(sparse_patch(p.name, self.held[key], bits, metas[p.name], p.start))
            held = self.held.get(key)
            if held is None:
                self.held[key] = bits.clone()
            else:
                held.copy_(bits)
        return None if first else out

    def reset(self) -> None:
        """After a sync the peer did not complete: the next ``patches()`` is None (a dense sync)."""
        self.exported = False


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
