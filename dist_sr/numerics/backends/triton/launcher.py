"""How one Triton kernel is launched from the host: the launch shapes and compiler options, the
device checks, and ``Launcher``, which launches a kernel Triton already compiled with raw
addresses instead of going through the JIT's argument binding on every call.

The multi-tensor launches built on it (``sr_launch``, ``adamw_launch``) never read a device value
back (no ``.item()``, no ``.tolist()``, no pageable copies), so a step runs under
``torch.cuda.set_sync_debug_mode("error")`` and can be captured in a CUDA graph. Under
``TRITON_INTERPRET=1`` the same code runs on CPU tensors (the tests' mode here). The functions a
dry run replaces (``interpreting``, ``check_device``, ``current_device``, ``raw_stream``) are
read from this module at each call, by the other host modules too.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from .interpret import interpreting

# Launch shapes (elements per program, warps per program). The bits never depend on them;
# DIST_SR_TRITON_{SR,ADAMW}_{BLOCK,WARPS} override them (bench/triton_tune.py measures the choices).
# The defaults are bench/triton_tune.py's picks on an H200 (2026-11-30): the SR cast at 8192 x 16
# took 0.391 ms at 2^28 elements, as long as the device copy of the same bytes (4096 x 8: 0.448);
# fused AdamW+SR was fastest at 1024 x 4 in both flavours (docs/runs.md, 2026-11-30).
SR_BLOCK = int(os.environ.get("DIST_SR_TRITON_SR_BLOCK", 8192))
SR_WARPS = int(os.environ.get("DIST_SR_TRITON_SR_WARPS", 16))
ADAMW_BLOCK = int(os.environ.get("DIST_SR_TRITON_ADAMW_BLOCK", 1024))
ADAMW_WARPS = int(os.environ.get("DIST_SR_TRITON_ADAMW_WARPS", 4))
ALIGN_BYTES = 16

# Bits must not depend on the compiler contracting a * b + c into one rounding (no FMA), so every
# launch that does floating-point arithmetic passes these options.
FP_OPTIONS = {"enable_fp_fusion": False}


def fp_options() -> dict:
    return {} if interpreting() else FP_OPTIONS


def check_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    device = tensors[0].device
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 to run them on the CPU"
        )
    for t in tensors:
        if t.device != device or not t.is_contiguous():
            raise ValueError("Triton kernels need contiguous tensors on one device")
    return device


def current_device() -> int:
    return torch._C._cuda_getDevice()


def raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


DIRECT = [True]  # False once this Triton's compiled-kernel launch interface turned out different


def run_compiled(kernel: Any, grid: int, device: int, args: Sequence) -> bool:
    """Launch a kernel Triton compiled, on ``device``'s current stream, with every argument as
    its signature lists them (pointers as raw addresses, constexprs included). False, with a
    one-time warning, if this Triton launches compiled kernels differently (the caller then goes
    through the JIT) or ``device`` is not the current device (the kernel is loaded there)."""
    if not DIRECT[0] or device != current_device():
        return False
    try:
        kernel.run(grid, 1, 1, raw_stream(device), kernel.function, kernel.packed_metadata, None, None, None, *args)
    except Exception as exc:  # another Triton's launcher interface: the JIT path from now on
        import warnings

        warnings.warn(
            f"dist_sr: direct Triton launch unavailable ({exc}); using the JIT launcher", RuntimeWarning, stacklevel=2
        )
        DIRECT[0] = False
        return False
    return True


class Launcher:
    """Launches a Triton kernel with little host work per call.

    Triton's JIT binds and specializes every argument on every call (tens of microseconds, which
    is most of a small rounding's cost). Here the first call of each specialization goes through
    the JIT (it compiles, caches and launches); later calls launch that compiled kernel directly.
    The specialization is Triton's own rule for these arguments: each pointer's 16-byte alignment
    and each integer's width (every integer parameter is ``do_not_specialize``). Under the
    interpreter, or if this Triton's launch interface is not the one expected, the JIT path is used.
    """

    def __init__(self, fn: Any):
        self.fn = fn
        self.names: list[str] = list(fn.arg_names)
        self.compiled: dict = {}
        self._orders: dict = {}  # per set of keyword arguments: the compiled call's argument list

    def __call__(self, grid: int, *args: Any, num_warps: int = 4, **kw: Any) -> None:
        if interpreting() or not DIRECT[0]:
            self.fn[(grid,)](*args, num_warps=num_warps, **kw)
            return
        device = current_device()
        spec = tuple(
            (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else -(1 << 31) <= a < (1 << 31)
            for a in args
        )
        kws = tuple(kw.items())  # a call site passes its keywords in one order: no sorting per call
        key = (spec, device, num_warps, kws)
        kernel = self.compiled.get(key)
        if kernel is None:
            self.compiled[key] = self.fn[(grid,)](*args, num_warps=num_warps, **kw)
            return
        order = self._orders.get(kws)
        if order is None:  # the positional arguments' places among the kernel's, the keywords filled in
            order = self._orders[kws] = (
                [kw.get(n) for n in self.names],
                [i for i, n in enumerate(self.names) if n not in kw],
            )
        full = order[0].copy()
        # raw addresses: the launcher would otherwise call data_ptr() and ask the driver about each
        for i, a in zip(order[1], args):
            full[i] = a.data_ptr() if isinstance(a, torch.Tensor) else a
        if not run_compiled(kernel, grid, device, full):
            self.fn[(grid,)](*args, num_warps=num_warps, **kw)


LAUNCHERS: dict[Any, Launcher] = {}


def launcher(fn: Any) -> Launcher:
    """The ``Launcher`` of a ``triton.jit`` function (one per function)."""
    la = LAUNCHERS.get(fn)
    if la is None:
        la = LAUNCHERS[fn] = Launcher(fn)
    return la
