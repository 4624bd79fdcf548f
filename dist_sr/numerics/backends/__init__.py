"""Rounding backends: where the keyed rounding and the fused AdamW step run.

Every backend gives the bits of ``numerics.reference`` (the tests pin each one to it and to the
published vectors); they differ in speed and in the devices they serve. A backend is one module
with one object satisfying ``Backend``, registered here; ``"auto"`` picks, for a tensor's device,
the first registered backend that serves that device and can run here, else the reference with
a one-time warning. Built in: ``reference`` (pure torch, any device), ``cpu`` (C++/OpenMP,
built on first use), ``triton`` (CUDA; Triton's interpreter on CPU tensors for tests).
"""

from __future__ import annotations

import warnings
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
    device_keys: bool              # can derive keys from a ``DeviceStep`` (steps captured in CUDA graphs)
    shaped: bool                   # round_one takes contiguous tensors of any shape (else flat views)

    def unavailable(self) -> str | None:
        """Why this backend cannot run in this process, or None."""

    def refuses(self, device: torch.device) -> str | None:
        """Why this backend cannot round tensors on ``device``, or None."""

    def round_one(self, x: torch.Tensor, out: torch.Tensor, key: int | None, offset: int,
                  rows: tuple[int, int] | None) -> None:
        """Flat FP32 ``x`` into flat BF16 ``out`` (element ``j`` at global index ``offset + j``, or
        a strided shard with ``rows = (row_len, row_stride)``); contiguous ones of any shape if
        ``shaped``."""

    def round_batch(self, batch: Any, idx: Sequence[int], keys: np.ndarray | None,
                    device_step: DeviceStep | None = None) -> None:
        """Pieces ``idx`` of a ``rounding.RoundingBatch`` (its ``xs``, ``outs``, ``offsets``,
        ``rows``, ``names``; ``launches`` is the backend's cache on the batch). ``keys``: one per
        piece of the batch, None for nearest, or (only to a backend with ``device_keys``) a
        ``KeyStep`` to derive them from."""

    def adamw_step(self, plan: Any, idx: Sequence[int], grads: Sequence[torch.Tensor], hypers: Sequence[Any],
                   slots: Sequence[int], keys: np.ndarray | None, grad_scale: torch.Tensor | None,
                   device_step: DeviceStep | None = None) -> None:
        """One fused AdamW step on pieces ``idx`` of a ``fused.AdamWPlan``. ``keys``: int64
        ``[3, T]`` (each piece's key, then its moments'), None for nearest, or (only to a backend
        with ``device_keys``) a ``KeyStep`` to derive them from."""


_REGISTRY: dict[str, Backend] = {}
_warned: set[str] = set()
# choose()'s answers for CUDA tensors, by the user's choice: on a GPU the choice is made on every
# public call, and for CUDA it depends on nothing but the registry (cleared when that changes)
_CUDA_CHOICE: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add a backend (a new one: one module with one ``Backend`` object, and this call)."""
    _REGISTRY[backend.name] = backend
    _CUDA_CHOICE.clear()


def names() -> tuple[str, ...]:
    """Every backend a user may name, ``"auto"`` first."""
    return ("auto", *_REGISTRY)


def check_name(name: str) -> str:
    if name != "auto" and name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(names())}")
    return name


def get(name: str) -> Backend:
    return _REGISTRY[name]


def choose(name: str, param: str, device: torch.device) -> Backend:
    """The backend that rounds ``param``'s tensors on ``device`` under the user's choice ``name``."""
    if device.type == "cuda":
        chosen = _CUDA_CHOICE.get(name)
        if chosen is None:
            chosen = _CUDA_CHOICE[name] = _choose(name, param, device)
        return chosen
    return _choose(name, param, device)


def _choose(name: str, param: str, device: torch.device) -> Backend:
    check_name(name)
    if name != "auto":
        backend = _REGISTRY[name]
        why = backend.unavailable()
        if why:
            raise RuntimeError(f"backend {name!r} unavailable: {why}")
        why = backend.refuses(device)
        if why:
            raise ValueError(f"backend {name!r} cannot round {param!r}: {why}")
        return backend
    reasons = []
    for backend in _REGISTRY.values():
        if device.type in backend.auto_devices:
            why = backend.unavailable()
            if why is None:
                return backend
            reasons.append(f"{backend.name}: {why}")
    if reasons and device.type not in _warned:
        _warned.add(device.type)
        warnings.warn(f"dist_sr: fast {device.type.upper()} rounding kernel unavailable ({'; '.join(reasons)}); using "
                      "the pure-torch reference, which gives the same bits but is ~100x slower", RuntimeWarning,
                      stacklevel=5)
    return _REGISTRY["reference"]


from . import cpu, reference, triton  # noqa: E402  (the built-in backends, registered in this order)

for _builtin in (reference.BACKEND, cpu.BACKEND, triton.BACKEND):
    register_backend(_builtin)
