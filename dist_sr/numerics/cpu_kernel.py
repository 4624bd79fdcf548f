"""Builds (on first use) and loads the C++ CPU kernel; reports why when it cannot.

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

_SOURCE = Path(__file__).parent / "csrc" / "sr_cpu.cpp"
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


_warned = False


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


def get() -> ModuleType | None:
    """The kernel, or None after a one-time warning that names what is missing."""
    global _warned
    try:
        return load()
    except KernelUnavailable as exc:
        if not _warned:
            _warned = True
            warnings.warn(
                f"dist_sr: fast CPU rounding kernel unavailable ({exc}); using the pure-torch "
                "reference, which gives the same bits but is ~100x slower. Install a C++ compiler "
                "(g++) and ninja to enable it.",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
