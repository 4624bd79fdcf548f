"""The fused AdamW step's launches: ``AdamWLaunch`` over a fixed list of flat tensors (tables
built once; a step uploads its keys, gradient addresses and constants in one copy and launches
once per (alignment, gradient dtype) group, normally once).

One entry point per way a step's keys and constants are given: ``with_keys`` (host keys, or
None for nearest, and host constants), ``at_step`` (a ``KeyStep``: keys derived on the device
from the uploaded step) and ``on_device`` (a ``DeviceStep``: keys and constants derived on the
device from a device counter, for steps captured in CUDA graphs).
"""

from __future__ import annotations

from operator import attrgetter
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..base import DeviceStep, KeyStep
from . import kernels as tk
from . import launcher as la
from . import tables

_DTYPE = attrgetter("dtype")


class _Group(NamedTuple):
    """One launch of a step: which tensors (``sel`` into the live ones, ``rows`` among all
    given), and their per-step rows (gradient addresses, then constant slots)."""

    aligned: bool
    grad_bf16: bool
    sel: Sequence[int]
    rows: Sequence[int]
    size: int
    step_rows: np.ndarray


class AdamWLaunch:
    """Fused AdamW over a fixed list of flat tensors (see ``kernels.adamw_many_kernel``).

    ``params``/``exp_avgs``/``exp_avg_sqs``: flat contiguous tensors; ``outs``: the BF16 working
    tensors of FP32 shadows, or None for BF16 parameters updated in place (``pure``);
    ``offsets``: each piece's global index; ``names``: [param names, exp_avg names, exp_avg_sq
    names], needed by the entry points that derive keys on the device.

    Every entry point takes ``grads`` (one per tensor given at construction: contiguous, float32
    or bfloat16, the tensor's numel and device, which ``fused.AdamWPlan`` checks), ``slots``
    (each tensor's row of the step's constants) and ``scale`` (a one-element FP32 device tensor
    multiplying the gradients).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        exp_avgs: Sequence[torch.Tensor],
        exp_avg_sqs: Sequence[torch.Tensor],
        outs: Sequence[torch.Tensor] | None,
        offsets: Sequence[int],
        *,
        pure: bool,
        moment_bf16: bool,
        names: Sequence[Sequence[str]] | None = None,
    ):
        self.pure, self.moment_bf16 = pure, moment_bf16
        self.names = names
        self._templates: dict[tuple, tables.KeyTemplates] = {}
        self._uploaded: dict[tuple, tuple[bytes, torch.Tensor]] = {}
        outs = outs if outs is not None else params
        self.device = la.check_device([t for ts in (params, exp_avgs, exp_avg_sqs, outs) for t in ts])
        self.live = [i for i, p in enumerate(params) if p.numel()]
        self.addresses = [[ts[i].data_ptr() for i in self.live] for ts in (params, exp_avgs, exp_avg_sqs, outs)]
        self.ns = [params[i].numel() for i in self.live]
        self.g0 = [offsets[i] for i in self.live]
        self._tables: dict[tuple, tables.TensorTable] = {}
        # which pieces may take the 16-byte path, gradients aside (checked per step)
        self._static_aligned = np.asarray(
            [
                self.g0[k] % 4 == 0 and all(a[k] % la.ALIGN_BYTES == 0 for a in self.addresses)
                for k in range(len(self.live))
            ],
            dtype=bool,
        )
        self._everything, self._live = tuple(range(len(self.live))), tuple(self.live)  # hashed per step: no copies

    def with_keys(
        self,
        grads: Sequence[torch.Tensor],
        keys: np.ndarray | None,
        slots: Sequence[int] | np.ndarray,
        consts: np.ndarray | None,
        scale: torch.Tensor,
    ) -> None:
        """``keys``: int64 ``[3, T]`` (param, exp_avg, exp_avg_sq keys) or None for nearest;
        ``consts``: float32 ``[S, 8]`` (``kernels.ADAMW_CONSTS``), one row per slot."""
        keyed = keys is not None
        consts64 = _consts(consts)
        for g in self._groups(grads, slots, None):
            key_rows = keys[:, g.rows] if keys is not None else np.zeros((3, g.size), dtype=np.int64)
            step = tables.upload(
                np.concatenate([key_rows.astype(np.int64).reshape(-1), g.step_rows, consts64]), self.device
            )
            key_dev, step = step[: 3 * g.size], step[3 * g.size :]
            self._launch(g, key_dev, step, step[2 * g.size :].view(torch.float32), scale, keyed)

    def at_step(
        self,
        grads: Sequence[torch.Tensor],
        key_step: KeyStep,
        slots: Sequence[int] | np.ndarray,
        consts: np.ndarray,
        scale: torch.Tensor,
        dtypes: set | None = None,
    ) -> None:
        """The keys of ``key_step``, derived on the device from the step, uploaded with the
        gradient addresses and constants: no per-name hashing on the host. ``dtypes``: the
        gradients' dtypes, if the caller has them."""
        consts64 = _consts(consts)
        lanes = 3 if self.moment_bf16 else 1  # FP32 moments are not rounded: the parameters' keys only
        for g in self._groups(grads, slots, dtypes):
            step = tables.upload(
                np.concatenate([np.asarray([key_step.counter()], np.int64), g.step_rows, consts64]), self.device
            )
            key_dev = torch.empty(3 * g.size, dtype=torch.int64, device=self.device)
            self._template(g, DeviceStep(step, key_step.seed, key_step.mode), lanes).run(step[:1], key_dev)
            step = step[1:]
            self._launch(g, key_dev, step, step[2 * g.size :].view(torch.float32), scale, True)

    def on_device(
        self,
        grads: Sequence[torch.Tensor],
        device_step: DeviceStep,
        slots: Sequence[int] | np.ndarray,
        hyper: np.ndarray,
        scale: torch.Tensor,
    ) -> None:
        """Keys and constants of step ``device_step.counter + 1`` derived on the device (``hyper``:
        float64 ``[S, 5]`` = lr, beta1, beta2, eps, weight decay), so the step replays correctly
        from a CUDA graph; the step's data is uploaded again only when it changed."""
        hyper64 = np.ascontiguousarray(hyper, dtype=np.float64).reshape(-1, 5)
        for g in self._groups(grads, slots, None):
            step = self._static_upload(
                (g.aligned, g.grad_bf16), np.concatenate([g.step_rows, hyper64.view(np.int64).reshape(-1)])
            )
            key_dev = torch.empty(3 * g.size, dtype=torch.int64, device=self.device)
            const_dev = torch.empty(hyper64.shape[0] * 8, dtype=torch.float32, device=self.device)
            self._template(g, device_step).run(
                device_step.counter, key_dev, step[2 * g.size :].view(torch.float64), const_dev, hyper64.shape[0]
            )
            self._launch(g, key_dev, step, const_dev, scale, True)

    def _groups(self, grads: Sequence[torch.Tensor], slots, dtypes: set | None) -> list[_Group]:
        """The step's launches: normally one over every tensor; split by 16-byte alignment and
        gradient dtype when they differ."""
        if not self.live:
            return []
        live = self.live
        slots = np.asarray(slots, dtype=np.int64)
        if len(live) != len(grads):  # some tensors are empty
            grads, slots = [grads[i] for i in live], slots[live]
        # C-level passes over the gradients, no Python loop per tensor (``grads`` is a step's
        # every gradient: this is most of a step's host work); their dtype, numel, device and
        # contiguity were checked by the caller (``fused.AdamWPlan``)
        ga = np.asarray(list(map(torch.Tensor.data_ptr, grads)), dtype=np.int64)
        if dtypes is None:
            dtypes = set(map(_DTYPE, grads))
        ok = self._static_aligned & (ga % la.ALIGN_BYTES == 0)
        if len(dtypes) == 1 and ok.all():  # the usual case: one launch
            return [
                _Group(
                    True, torch.bfloat16 in dtypes, self._everything, self._live, len(live), np.concatenate([ga, slots])
                )
            ]
        bf16 = np.asarray([g.dtype == torch.bfloat16 for g in grads])
        out = []
        for aligned in (True, False):
            for grad_bf16 in (True, False):
                sel = np.flatnonzero((ok == aligned) & (bf16 == grad_bf16)).tolist()
                if sel:
                    rows = [live[k] for k in sel]
                    out.append(_Group(aligned, grad_bf16, sel, rows, len(sel), np.concatenate([ga[sel], slots[sel]])))
        return out

    def _launch(
        self, g: _Group, keys: torch.Tensor, step: torch.Tensor, consts: torch.Tensor, scale: torch.Tensor, keyed: bool
    ) -> None:
        table = self._table(g.aligned, g.sel)
        la.launcher(tk.adamw_many_kernel)(
            table.grid,
            table.meta,
            table.bmap,
            keys,
            step[: 2 * g.size],
            consts,
            scale,
            table.count,
            KEYED=keyed,
            ALIGNED=g.aligned,
            GRAD_BF16=g.grad_bf16,
            PURE=self.pure,
            MOMENT_BF16=self.moment_bf16,
            BLOCK=la.ADAMW_BLOCK,
            num_warps=la.ADAMW_WARPS,
            **la.fp_options(),
        )

    def _table(self, aligned: bool, idx: Sequence[int]) -> tables.TensorTable:
        key = (la.ADAMW_BLOCK, aligned, tuple(idx))
        table = self._tables.get(key)
        if table is None:
            fields = tuple(tuple(a[i] for i in idx) for a in (*self.addresses, self.ns, self.g0))
            table = tables.make_table(fields, fields[4], fields[5], la.ADAMW_BLOCK, aligned, self.device)
            self._tables[key] = table
        return table

    def _static_upload(self, group: tuple, array: np.ndarray) -> torch.Tensor:
        """The device copy of a capturable step's data (gradient addresses, slots, hyper-parameters),
        uploaded again only when it changed: a captured loop's steady state uploads nothing, and a
        capture never allocates pinned memory."""
        content = array.tobytes()
        cached = self._uploaded.get(group)
        if cached is None or cached[0] != content:
            cached = self._uploaded[group] = (content, tables.upload(array, self.device))
        return cached[1]

    def _template(self, g: _Group, step: DeviceStep, kinds: int = 3) -> tables.KeyTemplates:
        key = (g.aligned, tuple(g.rows), step.seed, step.mode, kinds)
        tmpl = self._templates.get(key)
        if tmpl is None:
            if self.names is None:
                raise ValueError("keys derived on the device need the tensors' names (AdamWLaunch(names=...))")
            # lanes: the params' names, then their moments' (the kernel reads keys[3, T])
            lanes = [self.names[r][i] for r in range(kinds) for i in g.rows]
            tmpl = self._templates[key] = tables.KeyTemplates(lanes, step.seed, step.mode, self.device)
        return tmpl


def _consts(consts: np.ndarray | None) -> np.ndarray:
    """A step's float32 constants ``[S, 8]`` as the int64 words they are uploaded in."""
    c = np.ascontiguousarray(consts if consts is not None else np.zeros(8), dtype=np.float32).reshape(-1, 8)
    return c.view(np.int64).reshape(-1)


SCALES: dict[tuple[float, torch.device], torch.Tensor] = {}


def scale_tensor(value: float, device: torch.device) -> torch.Tensor:
    """A cached one-element FP32 device tensor (made once per value and device, so no per-step upload)."""
    t = SCALES.get((value, device))
    if t is None:
        t = torch.full((1,), value, dtype=torch.float32, device=device)
        SCALES[(value, device)] = t
    return t
