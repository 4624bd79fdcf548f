"""The Triton backend for CUDA tensors (and, under ``TRITON_INTERPRET=1``, CPU tensors in Triton's
interpreter, which is how it is tested without a GPU). ``kernels`` and ``keys`` are the device
code; the host side is ``launcher`` (one kernel's launch), ``tables`` (what a multi-tensor launch
keeps on the device), ``sr_launch`` and ``adamw_launch`` (the two operations' launches) and
``dry_run`` (the host side alone, without a GPU). Triton is imported only when something is
launched."""

from __future__ import annotations

import numpy as np
import torch

from ...adamw import constants, distinct_rows
from ...key import signed64, stream_key
from ..base import KeyStep
from .interpret import interpreting


def _sr_launch():
    """The SR cast's host-side module (imports Triton): imported on first use, then one global
    read per call."""
    global _SR_LAUNCH
    if _SR_LAUNCH is None:
        from . import sr_launch

        _SR_LAUNCH = sr_launch
    return _SR_LAUNCH


_SR_LAUNCH = None


class TritonBackend:
    """Rounds CUDA tensors with Triton kernels: every piece of a call in one launch."""

    name, device_keys, shaped = "triton", True, True  # see numerics.backends.Backend
    auto_devices: tuple[str, ...] = ("cuda",)

    def unavailable(self) -> str | None:
        try:
            import triton  # noqa: F401  (availability probe)
        except ImportError as exc:
            return f"triton is not installed ({exc})"
        return None

    def refuses(self, device: torch.device) -> str | None:
        if device.type == "cuda" or interpreting():
            return None
        return f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 to run them on the CPU"

    def round_one(self, x, out, key, offset, rows) -> None:
        _sr_launch().round_one(x, out, key, offset, rows)

    def round_batch(self, batch, idx, keys, device_step=None) -> None:
        sr = _sr_launch()

        keyed = keys is not None
        split = batch.launches.get(("triton-split", keyed, tuple(idx)))
        if split is None:  # the batch's pieces are fixed: which take their own launch is decided once
            own = [i for i in idx if keyed and batch.rows[i] is not None]  # keyed strided shards
            flat = tuple(i for i in idx if not (keyed and batch.rows[i] is not None))
            split = batch.launches[("triton-split", keyed, tuple(idx))] = (own, flat, [batch.names[i] for i in flat])
        own, flat, names = split
        for i in own:
            if isinstance(keys, KeyStep):
                key = signed64(stream_key(seed=keys.seed, step=keys.step, param=batch.names[i], mode=keys.mode))
            else:
                key = int(keys[i])
            sr.round_one(batch.xs[i], batch.outs[i], key, batch.offsets[i], batch.rows[i])
        if not flat:
            return
        cached = batch.launches.get(("triton", flat))
        if cached is None:
            cached = sr.SRLaunch(
                [batch.xs[i] for i in flat], [batch.outs[i] for i in flat], [batch.offsets[i] for i in flat]
            )
            batch.launches[("triton", flat)] = cached
        if device_step is not None:
            cached.on_device(device_step, names)
        elif isinstance(keys, KeyStep):
            cached.at_step(keys, names)
        else:
            cached.with_keys(None if keys is None else keys[list(flat)])

    def adamw_step(self, plan, idx, grads, hypers, slots, keys, grad_scale, device_step=None) -> None:
        from . import adamw_launch

        slots = np.asarray(slots, dtype=np.int64)
        for (pure, moment_bf16, scale), sel in plan.groups(idx, hypers, slots, grad_scale).items():
            cached = plan.launches.get((pure, tuple(sel)))
            if cached is None:
                flat = [plan.flat[i] for i in sel]
                names = [[plan.names[i] for i in sel]] + [[row[i] for i in sel] for row in plan.moment_names]
                cached = adamw_launch.AdamWLaunch(
                    [f[0] for f in flat],
                    [f[1] for f in flat],
                    [f[2] for f in flat],
                    None if pure else [f[3] for f in flat],
                    [plan.pieces[i].offset for i in sel],
                    pure=pure,
                    moment_bf16=moment_bf16,
                    names=names,
                )
                plan.launches[(pure, tuple(sel))] = cached
            every = len(sel) == len(grads)  # the usual step: every piece, in order
            used, rows = distinct_rows(slots if every else slots[sel])
            used = used.tolist()
            sel_grads = grads if every else [grads[i] for i in sel]
            device = plan.pieces[sel[0]].p.device
            scale_t = grad_scale.reshape(1) if scale is None else adamw_launch.scale_tensor(scale, device)
            if device_step is not None:
                hyper = np.asarray(
                    [[h.lr, h.beta1, h.beta2, h.eps, h.weight_decay] for h in (hypers[s] for s in used)],
                    dtype=np.float64,
                )
                cached.on_device(sel_grads, device_step, rows, hyper, scale_t)
                continue
            consts = np.asarray([constants(hypers[s]) for s in used], dtype=np.float32)
            if isinstance(keys, KeyStep):
                cached.at_step(sel_grads, keys, rows, consts, scale_t, dtypes=plan.grad_dtypes if every else None)
                continue
            cached.with_keys(sel_grads, None if keys is None else keys[:, sel], rows, consts, scale_t)


BACKEND = TritonBackend()
