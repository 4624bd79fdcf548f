"""The contract between the rounding backends and their callers: what a backend provides
(``Backend``) and the two ways a caller hands it the key's step (``KeyStep``, ``DeviceStep``).
Every backend module imports these from here (not from the package that registers them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..key import check_seed_step, signed64


@dataclass
class DeviceStep:
    """The key's step as a device counter, for steps that replay from a CUDA graph: ``counter``
    (int64, one element) holds the step of the live result; a launch derives the keys (and AdamW
    constants) of ``counter + 1`` on the device, and the caller advances the counter after it."""

    counter: torch.Tensor
    seed: int
    mode: str


@dataclass(frozen=True)
class KeyStep:
    """The key of a host-known step, for a backend that derives keys on the device
    (``device_keys``): instead of hashing every name on the host each step, it uploads the step
    with the step's other data and derives the keys there (the bits of ``key.stream_keys``)."""

    seed: int
    step: int
    mode: str

    def __post_init__(self):
        check_seed_step(self.seed, self.step)
        if self.mode not in ("stochastic", "dither"):
            raise ValueError(f"mode {self.mode!r} has no keys; keyed modes are 'stochastic' and 'dither'")

    def counter(self) -> int:
        """The step before, as the signed 64-bit value a device counter holds (the key kernel
        derives the keys of ``counter + 1``)."""
        before = (self.step - 1) % (1 << 64)
        return signed64(before)


class Backend(Protocol):
    """What a rounding backend provides. ``keys`` are stream keys as signed 64-bit values (an int,
    or an int64 array with one entry per piece), ``None`` meaning round-to-nearest-even."""

    name: str
    auto_devices: tuple[str, ...]  # device types "auto" may pick this backend for
    device_keys: bool  # can derive keys from a ``DeviceStep`` (steps captured in CUDA graphs)
    shaped: bool  # round_one takes contiguous tensors of any shape (else flat views)

    def unavailable(self) -> str | None:
        """Why this backend cannot run in this process, or None."""

    def refuses(self, device: torch.device) -> str | None:
        """Why this backend cannot round tensors on ``device``, or None."""

    def round_one(
        self, x: torch.Tensor, out: torch.Tensor, key: int | None, offset: int, rows: tuple[int, int] | None
    ) -> None:
        """Flat FP32 ``x`` into flat BF16 ``out`` (element ``j`` at global index ``offset + j``, or
        a strided shard with ``rows = (row_len, row_stride)``); contiguous ones of any shape if
        ``shaped``."""

    def round_batch(
        self, batch: Any, idx: Sequence[int], keys: np.ndarray | KeyStep | None, device_step: DeviceStep | None = None
    ) -> None:
        """Pieces ``idx`` of a ``rounding.RoundingBatch`` (its ``xs``, ``outs``, ``offsets``,
        ``rows``, ``names``; ``launches`` is the backend's cache on the batch). ``keys``: one per
        piece of the batch, None for nearest, or (only to a backend with ``device_keys``) a
        ``KeyStep`` to derive them from."""

    def adamw_step(
        self,
        plan: Any,
        idx: Sequence[int],
        grads: Sequence[torch.Tensor | None],
        hypers: Sequence[Any],
        slots: Sequence[int] | np.ndarray,
        keys: np.ndarray | KeyStep | None,
        grad_scale: torch.Tensor | None,
        device_step: DeviceStep | None = None,
    ) -> None:
        """One fused AdamW step on pieces ``idx`` of a ``fused.AdamWPlan``. ``keys``: int64
        ``[3, T]`` (each piece's key, then its moments'), None for nearest, or (only to a backend
        with ``device_keys``) a ``KeyStep`` to derive them from."""
