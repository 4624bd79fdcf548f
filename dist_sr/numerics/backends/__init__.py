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

import torch

from ...registry import Registry
from .base import Backend, DeviceStep, KeyStep  # noqa: F401  (the contract, re-exported)

_REGISTRY: Registry[Backend] = Registry("rounding backend")
_warned: set[str] = set()
# choose()'s answers for CUDA tensors, by the user's choice: on a GPU the choice is made on every
# public call, and for CUDA it depends on nothing but the registry (cleared when that changes)
_CUDA_CHOICE: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add a backend (a new one: one module with one ``Backend`` object, and this call)."""
    _REGISTRY.register(backend.name, backend)
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
        warnings.warn(
            f"dist_sr: fast {device.type.upper()} rounding kernel unavailable ({'; '.join(reasons)}); using "
            "the pure-torch reference, which gives the same bits but is ~100x slower",
            RuntimeWarning,
            stacklevel=5,
        )
    return _REGISTRY["reference"]


from . import cpu, reference, triton  # noqa: E402  (the built-in backends, registered in this order)

for _builtin in (reference.BACKEND, cpu.BACKEND, triton.BACKEND):
    register_backend(_builtin)
