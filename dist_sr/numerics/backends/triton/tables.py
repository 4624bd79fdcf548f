"""What a multi-tensor launch keeps on the device: the tensor table (pointers, lengths, offsets)
built once per tensor set and cached, the key templates of a fixed list of names, and the one
upload path (non-blocking, from pinned memory) by which anything per step reaches the device.

Their sizes grow with the number of tensors, never with the number of elements.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ...key import STEP_BYTE, key_message
from . import kernels as tk
from . import keys as triton_keys
from . import launcher as la

CACHE_SIZE = 256
KEY_LANES = 64


@dataclass(frozen=True)
class TensorTable:
    """A multi-tensor launch's fixed part, on the device: ``meta`` (int64, fields x tensors),
    ``bmap`` (each program's tensor and block, expanded on the device from O(T) block counts)
    and the grid."""

    meta: torch.Tensor
    bmap: torch.Tensor
    count: int
    grid: int


def table_arrays(
    fields: Sequence[Sequence[int]], ns: Sequence[int], g0s: Sequence[int], block: int, aligned: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The host arrays of a ``TensorTable``: ``meta`` (len(fields) x T, int64) and ``starts``.

    Their sizes depend on the number of tensors only: a tensor of ``n`` elements is one entry
    whatever ``n`` is (its block count is a number in ``starts``, not a row per block)."""
    meta = np.asarray(fields, dtype=np.int64).reshape(len(fields), len(ns))
    shift = 0 if aligned else np.asarray(g0s, dtype=np.int64) % 4
    blocks = -(-(np.asarray(ns, dtype=np.int64) + shift) // block)
    starts = np.zeros(len(ns) + 1, dtype=np.int64)
    np.cumsum(blocks, out=starts[1:])
    return meta, starts


class TableCache:
    """The most recently used ``CACHE_SIZE`` tables by signature (what the table was built from)."""

    def __init__(self) -> None:
        self._tables: OrderedDict[tuple, TensorTable] = OrderedDict()

    def table(self, signature: tuple, build: Callable[[], TensorTable]) -> TensorTable:
        table = self._tables.get(signature)
        if table is None:
            table = build()
            self._tables[signature] = table
            if len(self._tables) > CACHE_SIZE:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(signature)
        return table

    def clear(self) -> None:
        self._tables.clear()

    def __len__(self) -> int:
        return len(self._tables)


TABLES = TableCache()
# Host buffers captured into a CUDA graph must outlive it: kept here (one per captured upload).
_CAPTURED: list[torch.Tensor] = []


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device``: one non-blocking copy from pinned memory (the caching host
    allocator does not reuse the buffer before the copy has run)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host
    pinned = host.pin_memory()
    if torch.cuda.is_current_stream_capturing():
        _CAPTURED.append(pinned)
    return pinned.to(device, non_blocking=True)


def make_table(
    fields: Sequence[Sequence[int]], ns: Sequence[int], g0s: Sequence[int], block: int, aligned: bool, device
) -> TensorTable:
    """Upload a table's arrays in one copy and expand its block map on the device."""
    meta, starts = table_arrays(fields, ns, g0s, block, aligned)
    both = upload(np.concatenate([meta.reshape(-1), starts]), device)
    grid = int(starts[-1])
    bmap = torch.empty(max(grid, 1), dtype=torch.int64, device=device)
    tk.block_map_kernel[(len(ns),)](both[meta.size :], bmap, CHUNK=1024)
    return TensorTable(both[: meta.size], bmap, len(ns), grid)


def split_by_alignment(
    count: int, addresses: Sequence[Sequence[int]], g0s: Sequence[int]
) -> list[tuple[bool, list[int]]]:
    """Indices of the aligned pieces and of the others (the second group is usually empty)."""
    flags = [g0s[i] % 4 == 0 and all(a[i] % la.ALIGN_BYTES == 0 for a in addresses) for i in range(count)]
    groups = [(True, [i for i in range(count) if flags[i]]), (False, [i for i in range(count) if not flags[i]])]
    return [(aligned, idx) for aligned, idx in groups if idx]


class KeyTemplates:
    """The key messages of a fixed list of names with the step left zero, on the device
    (``[16 * NB, T]`` little-endian words and each message's length), for ``step_data_kernel``:
    the per-step data (keys, AdamW's constants) derived on the device from a step counter, so a
    step captured in a CUDA graph replays correctly."""

    def __init__(self, names: Sequence[str], seed: int, mode: str, device: torch.device):
        msgs = [key_message(n, seed=seed, step=0, mode=mode) for n in names]
        self.count = len(msgs)
        self.blocks = max(1, max(-(-len(m) // 128) for m in msgs))
        raw = np.zeros((len(msgs), self.blocks * 128), dtype=np.uint8)
        for i, m in enumerate(msgs):
            raw[i, : len(m)] = np.frombuffer(m, dtype=np.uint8)
        words = np.ascontiguousarray(raw.view("<u8").view(np.int64).T)
        sigma = np.asarray(triton_keys.SIGMA, dtype=np.int64).reshape(-1)
        both = upload(
            np.concatenate([words.reshape(-1), np.asarray([len(m) for m in msgs], dtype=np.int64), sigma]), device
        )
        self.words, self.lens = both[: words.size], both[words.size : words.size + len(msgs)]
        self.sigma = both[words.size + len(msgs) :]
        self.stochastic = mode == "stochastic"

    def run(
        self,
        counter: torch.Tensor,
        keys: torch.Tensor,
        hyper: torch.Tensor | None = None,
        consts: torch.Tensor | None = None,
        slots: int = 0,
    ) -> None:
        """Keys of step ``counter + 1`` into ``keys``; with ``hyper`` (float64 ``[slots, 5]``:
        lr, beta1, beta2, eps, weight decay), AdamW's constants of that step into ``consts``."""
        la.launcher(triton_keys.step_data_kernel)(
            la.cdiv(self.count, KEY_LANES),
            self.words,
            self.lens,
            self.sigma,
            counter,
            keys,
            self.count,
            keys if hyper is None else hyper,
            keys if consts is None else consts,
            slots,
            self.blocks,
            STEP_BYTE=STEP_BYTE,
            KEYED_STEP=self.stochastic,
            BT=KEY_LANES,
            BS=max(1, 1 << (max(slots, 1) - 1).bit_length()),
            **la.fp_options(),
        )
