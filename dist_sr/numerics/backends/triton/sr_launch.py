"""The SR cast's launches: ``round_one`` for one tensor (its pointers, length, offset and key are
kernel arguments; nothing is uploaded) and ``SRLaunch`` for a fixed list of tensors (one cached
table, then per call only the keys uploaded, in one launch per alignment group).

``SRLaunch`` has one entry point per way the keys are given: ``with_keys`` (host keys, or None
for nearest), ``at_step`` (a ``KeyStep``: the keys derived on the device from the step, no
per-name hashing on the host) and ``on_device`` (a ``DeviceStep``: the step itself is a device
counter, for steps captured in CUDA graphs).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ...key import signed64, stream_key
from ..base import DeviceStep, KeyStep
from . import kernels as tk
from . import launcher as la
from . import tables

# Compiled one-tensor SR casts by specialization (see ``round_one``).
ONE: dict[tuple, object] = {}


def round_one(
    x: torch.Tensor, out: torch.Tensor, key: int | None, offset: int, rows: tuple[int, int] | None = None
) -> None:
    """One contiguous FP32 tensor into a contiguous BF16 one of as many elements; ``key`` signed
    64-bit or None (nearest).

    This is every public ``stochastic_round`` call on a GPU, so its host work is kept to what a
    torch operator costs: after the first call of a specialization (the launch shape, the
    device, each pointer's 16-byte alignment, each integer's width: Triton's own rule), the
    compiled kernel is launched directly with raw addresses, no tensor views and no argument
    binding."""
    n = x.numel()
    if n == 0:
        return
    keyed = key is not None
    if rows is not None and keyed:
        la.check_device([x, out])
        la.launcher(tk.sr_rows_kernel)(
            la.cdiv(n, la.SR_BLOCK),
            x.view(torch.int32),
            out.view(torch.int16),
            n,
            offset,
            key,
            rows[0],
            rows[1],
            KEYED=True,
            BLOCK=la.SR_BLOCK,
            num_warps=la.SR_WARPS,
        )
        return
    xp, op = x.data_ptr(), out.data_ptr()
    k = key if key is not None else 0
    x16, o16 = xp % la.ALIGN_BYTES == 0, op % la.ALIGN_BYTES == 0
    aligned = x16 and o16 and offset % 4 == 0
    block = la.SR_BLOCK
    device = x.get_device()
    spec = (
        block,
        la.SR_WARPS,
        device,
        keyed,
        aligned,
        x16,
        o16,
        n < 1 << 31,
        offset < 1 << 31,
        -(1 << 31) <= k < 1 << 31,
    )
    kernel = ONE.get(spec)
    grid = -(-(n if aligned else n + offset % 4) // block)
    if (
        kernel is not None
        and out.get_device() == device
        and x.is_contiguous()
        and out.is_contiguous()
        and la.run_compiled(kernel, grid, device, (xp, op, n, offset, k, keyed, aligned, block))
    ):
        return
    la.check_device([x, out])
    compiled = tk.sr_one_kernel[(grid,)](
        x.view(torch.int32),
        out.view(torch.int16),
        n,
        offset,
        k,
        KEYED=keyed,
        ALIGNED=aligned,
        BLOCK=la.SR_BLOCK,
        num_warps=la.SR_WARPS,
    )
    if not la.interpreting() and la.DIRECT[0]:
        ONE[spec] = compiled


def _launch_many(table: tables.TensorTable, aligned: bool, keys: torch.Tensor, keyed: bool) -> None:
    la.launcher(tk.sr_many_kernel)(
        table.grid,
        table.meta,
        table.bmap,
        keys,
        table.count,
        KEYED=keyed,
        ALIGNED=aligned,
        BLOCK=la.SR_BLOCK,
        num_warps=la.SR_WARPS,
    )


def _table(xp: Sequence[int], op: Sequence[int], ns: Sequence[int], g0: Sequence[int], aligned: bool, device):
    fields = (list(xp), list(op), list(ns), list(g0))
    signature = ("sr", la.SR_BLOCK, device, aligned, *map(tuple, fields))
    return tables.TABLES.table(
        signature, lambda: tables.make_table(fields, fields[2], fields[3], la.SR_BLOCK, aligned, device)
    )


class SRLaunch:
    """Rounding of a fixed list of flat tensors, ready to run at any key: the tables are built
    (or found in the cache) here; a call uploads the keys and launches, once per alignment group."""

    def __init__(self, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], offsets: Sequence[int]):
        self.live = [i for i, x in enumerate(xs) if x.numel()]
        self.single: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
        self.groups: list[tuple[bool, list[int], tables.TensorTable]] = []
        self._eager_templates: dict[tuple, tables.KeyTemplates] = {}
        self._templates: list[tables.KeyTemplates] | None = None
        if len(self.live) == 1:
            i = self.live[0]
            self.single = (xs[i], outs[i], offsets[i], i)
            self.device = xs[i].device
            return
        if not self.live:
            return
        self.device = la.check_device([xs[i] for i in self.live] + [outs[i] for i in self.live])
        xa = [xs[i].data_ptr() for i in self.live]
        oa = [outs[i].data_ptr() for i in self.live]
        ns = [xs[i].numel() for i in self.live]
        g0 = [offsets[i] for i in self.live]
        for aligned, idx in tables.split_by_alignment(len(self.live), (xa, oa), g0):
            table = _table(
                [xa[i] for i in idx],
                [oa[i] for i in idx],
                [ns[i] for i in idx],
                [g0[i] for i in idx],
                aligned,
                self.device,
            )
            self.groups.append((aligned, [self.live[i] for i in idx], table))

    def with_keys(self, keys: np.ndarray | None) -> None:
        """``keys``: int64 stream keys, one per tensor given at construction; None: nearest."""
        if self.single is not None:
            x, out, offset, i = self.single
            round_one(x, out, None if keys is None else int(keys[i]), offset)
            return
        keyed = keys is not None
        for aligned, rows, table in self.groups:
            key_dev = tables.upload(keys[rows], self.device) if keys is not None else table.meta
            _launch_many(table, aligned, key_dev, keyed)

    def at_step(self, key_step: KeyStep, names: Sequence[str]) -> None:
        """The keys of ``key_step`` for the tensors' ``names``: one host hash for a lone tensor
        (a kernel argument), else derived on the device from the uploaded step."""
        if self.single is not None:
            x, out, offset, i = self.single
            key = stream_key(seed=key_step.seed, step=key_step.step, param=names[i], mode=key_step.mode)
            round_one(x, out, signed64(key), offset)
            return
        if not self.groups:
            return
        counter = tables.upload(np.asarray([key_step.counter()], dtype=np.int64), self.device)
        for aligned, rows, table in self.groups:
            key_dev = torch.empty(len(rows), dtype=torch.int64, device=self.device)
            self._eager_template(rows, names, key_step.seed, key_step.mode).run(counter, key_dev)
            _launch_many(table, aligned, key_dev, True)

    def on_device(self, step: DeviceStep, names: Sequence[str]) -> None:
        """The keys of step ``step.counter + 1`` (a device tensor) for the tensors' ``names``,
        derived on the device: nothing is uploaded, so the call replays from a CUDA graph."""
        if self.single is not None:  # one table like any other, so the key stays on the device
            x, out, offset, i = self.single
            self.groups = [
                (False, [i], _table([x.data_ptr()], [out.data_ptr()], [x.numel()], [offset], False, x.device))
            ]
            self.single = None
        if self._templates is None:
            self._templates = [
                tables.KeyTemplates([names[r] for r in rows], step.seed, step.mode, self.device)
                for _, rows, _ in self.groups
            ]
        for (aligned, rows, table), tmpl in zip(self.groups, self._templates):
            keys = torch.empty(len(rows), dtype=torch.int64, device=self.device)
            tmpl.run(step.counter, keys)
            _launch_many(table, aligned, keys, True)

    def _eager_template(self, rows: list[int], names: Sequence[str], seed: int, mode: str) -> tables.KeyTemplates:
        key = (tuple(rows), seed, mode)
        tmpl = self._eager_templates.get(key)
        if tmpl is None:
            tmpl = self._eager_templates[key] = tables.KeyTemplates([names[r] for r in rows], seed, mode, self.device)
        return tmpl


def round_many(
    xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], keys: np.ndarray | None, offsets: Sequence[int]
) -> None:
    """Flat FP32 tensors into flat BF16 tensors, one launch for all (two if some are misaligned).

    ``keys``: int64 array of stream keys (one per tensor), or None for round-to-nearest-even.
    """
    SRLaunch(xs, outs, offsets).with_keys(keys)
