"""The C++/OpenMP backend for CPU tensors: builds (on first use) and loads the kernel, reports
why when it cannot, and adapts it to the ``Backend`` interface.

The build is cached by ``torch.utils.cpp_extension`` under ``TORCH_EXTENSIONS_DIR``. The
extension is compiled with ``-march=native``, so its name carries a fingerprint of this CPU's
model and feature flags (a cache directory shared between different machines never hands one of
them code for another's instruction set) and of the Python environment (two virtual
environments sharing the cache, e.g. a trainer's and a vLLM engine's, would otherwise rebuild it
back and forth: their include paths differ).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from ..adamw import constants

_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "sr_cpu.cpp"
DISABLE_ENV = "DIST_SR_DISABLE_CPU_KERNEL"


def _cpu_fingerprint() -> str:
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    text += line
                if line.strip() == "":
                    break  # the first processor block describes them all
    except OSError:
        text += platform.processor()
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def _env_fingerprint() -> str:
    import sys

    import torch

    return hashlib.sha1(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:6]


class KernelUnavailable(RuntimeError):
    pass


STALE_LOCK_SECONDS = 900


def _clear_stale_lock(build_dir: str) -> None:
    """cpp_extension waits forever on a lock left by a process killed mid-build; a build takes
    under a minute, so a lock older than STALE_LOCK_SECONDS is removed (with a warning)."""
    import time

    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_SECONDS:
        warnings.warn(f"dist_sr: removing a stale build lock {lock} ({age:.0f} s old)", RuntimeWarning, stacklevel=3)
        lock.unlink(missing_ok=True)


@functools.lru_cache(maxsize=None)
def load() -> ModuleType:
    """The compiled module, or ``KernelUnavailable`` saying why it is not there."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        raise KernelUnavailable(f"disabled by {DISABLE_ENV}")
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        raise KernelUnavailable(f"untested CPU architecture {platform.machine()}")
    try:
        from torch.utils import cpp_extension

        name = f"dist_sr_cpu_{_cpu_fingerprint()}_{_env_fingerprint()}"
        _clear_stale_lock(cpp_extension._get_build_directory(name, verbose=False))
        # no FMA contraction (bits must match the reference); no errno from sqrt, so it vectorises
        flags = ["-O3", "-fopenmp", "-march=native", "-ffp-contract=off", "-fno-math-errno"]
        if platform.machine() in ("x86_64", "AMD64"):
            flags.append("-mprefer-vector-width=512")
        return cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # compiler missing, headers missing, build error
        raise KernelUnavailable(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}") from exc


def warm_up_in_background() -> None:
    """Load (building if needed, once per environment) on a daemon thread, so a process that only
    needs the kernel for speed, such as a vLLM worker computing digests, never waits for a
    compile; ``loaded()`` returns it once ready. A failure is logged by ``get()``'s rules: the
    torch paths stay in use."""
    import threading

    def run():
        try:
            load()
        except KernelUnavailable:
            pass

    threading.Thread(target=run, name="dist-sr-kernel-build", daemon=True).start()


def loaded() -> ModuleType | None:
    """The kernel if this process has already built or loaded it, else None (never builds: for
    paths such as digests inside a vLLM worker, which must not stall on a first compile)."""
    if load.cache_info().currsize == 0:
        return None
    try:
        return load()
    except KernelUnavailable:
        return None


class CPUBackend:
    """Rounds CPU tensors with the compiled kernel: one OpenMP pass, one hash per 4 elements."""

    name, device_keys, auto_devices = "cpu", False, ("cpu",)  # see numerics.backends.Backend

    def unavailable(self) -> str | None:
        try:
            load()
        except KernelUnavailable as exc:
            return f"{exc}; install a C++ compiler (g++) and ninja to enable it"
        return None

    def refuses(self, device: torch.device) -> str | None:
        return None if device.type == "cpu" else f"the C++ kernel rounds CPU tensors, this one is on {device}"

    def round_one(self, x, out, key, offset, rows) -> None:
        kernel = load()
        if rows is not None and key is not None:
            kernel.round_rows(x, out, key, offset, *rows)
        else:
            kernel.round_tensor(x, out, key is not None, 0 if key is None else key, offset)

    def round_batch(self, batch, idx, keys, device_step=None) -> None:
        if device_step is not None:
            raise ValueError("keys derived on the device need the Triton backend")
        kernel = load()
        flat = []
        for i in idx:
            if batch.rows[i] is not None and keys is not None:
                kernel.round_rows(batch.xs[i], batch.outs[i], int(keys[i]), batch.offsets[i], *batch.rows[i])
            else:
                flat.append(i)
        if flat:
            kernel.round_tensors([batch.xs[i] for i in flat], [batch.outs[i] for i in flat], keys is not None,
                                 [] if keys is None else keys[flat].tolist(), [batch.offsets[i] for i in flat])

    def adamw_step(self, plan, idx, grads, hypers, slots, keys, grad_scale, device_step=None) -> None:
        if device_step is not None:
            raise ValueError("steps derived on the device need the Triton backend")
        kernel = load()
        for (pure, _, scale), sel in plan.groups(idx, hypers, slots, grad_scale).items():
            flat = [plan.flat[i] for i in sel]
            consts = [v for i in sel for v in constants(hypers[slots[i]])]
            k = np.zeros(3 * len(sel), dtype=np.int64) if keys is None else keys[:, sel].T.reshape(-1)
            kernel.adamw_many([f[0] for f in flat], [f[1] for f in flat], [f[2] for f in flat],
                              [grads[i].reshape(-1) for i in sel], [] if pure else [f[3] for f in flat],
                              keys is not None, k.tolist(), [plan.pieces[i].offset for i in sel], consts,
                              float(grad_scale) if scale is None else scale)


BACKEND = CPUBackend()
