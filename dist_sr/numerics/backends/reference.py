"""The pure-torch backend: ``numerics.reference`` on any device, one piece at a time."""

from __future__ import annotations

import torch

from .. import reference


class ReferenceBackend:
    """The definition, in torch ops: slow, any device, the bits every backend is tested against."""

    name, device_keys, shaped = "reference", False, False  # see numerics.backends.Backend
    auto_devices: tuple[str, ...] = ()

    def unavailable(self) -> str | None:
        return None

    def refuses(self, device: torch.device) -> str | None:
        return None

    def round_one(self, x, out, key, offset, rows) -> None:
        reference.round_into(x, out, None if key is None else key % (1 << 64), offset, rows)

    def round_batch(self, batch, idx, keys, device_step=None) -> None:
        if device_step is not None:
            raise ValueError("keys derived on the device need the Triton backend")
        for i in idx:
            self.round_one(
                batch.xs[i], batch.outs[i], None if keys is None else int(keys[i]), batch.offsets[i], batch.rows[i]
            )

    def adamw_step(self, plan, idx, grads, hypers, slots, keys, grad_scale, device_step=None) -> None:
        if device_step is not None:
            raise ValueError("steps derived on the device need the Triton backend")
        for i in idx:
            pc = plan.pieces[i]
            k = None if keys is None else [int(x) % (1 << 64) for x in keys[:, i]]
            reference.adamw_step(
                pc.p,
                pc.exp_avg,
                pc.exp_avg_sq,
                grads[i],
                pc.out,
                None if k is None else k[0],
                pc.offset,
                hypers[slots[i]],
                None if k is None else (k[1], k[2]),
                pc.rows,
                grad_scale,
            )


BACKEND = ReferenceBackend()
