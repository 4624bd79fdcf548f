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
_DELTA_SOURCE = _SOURCE.with_name("delta_cpu.cpp")
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


class _BuildLock:
    """An exclusive ``flock`` on ``<build dir>.build-lock`` held around the build. The kernel
    releases it when its holder dies, so, while holding it, a ``lock`` file that cpp_extension left
    in the build directory can only be a dead builder's (a process killed mid-build, which would
    otherwise make every later process wait forever) and is removed."""

    def __init__(self, build_dir: str):
        self.build_dir = Path(build_dir)

    def __enter__(self):
        import fcntl

        self.build_dir.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(str(self.build_dir) + ".build-lock", "w")
        fcntl.flock(self.file, fcntl.LOCK_EX)
        stale = self.build_dir / "lock"
        if stale.exists():
            warnings.warn(f"dist_sr: removing {stale}, left by a build that was killed", RuntimeWarning, stacklevel=3)
            stale.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc):
        self.file.close()  # releases the flock
        return False


@functools.lru_cache(maxsize=None)
def load() -> ModuleType:
    """The compiled module, or ``KernelUnavailable`` saying why it is not there."""
    return _build("dist_sr_cpu", _SOURCE)


@functools.lru_cache(maxsize=None)
def load_delta() -> ModuleType:
    """The grid-step delta codec's module (``numerics.delta``), built like ``load()``'s."""
    return _build("dist_sr_delta", _DELTA_SOURCE)


def _build(stem: str, source: Path) -> ModuleType:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        raise KernelUnavailable(f"disabled by {DISABLE_ENV}")
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        raise KernelUnavailable(f"untested CPU architecture {platform.machine()}")
    try:
        from torch.utils import cpp_extension

        name = f"{stem}_{_cpu_fingerprint()}_{_env_fingerprint()}"
        # no FMA contraction (bits must match the reference); no errno from sqrt, so it vectorises
        flags = ["-O3", "-fopenmp", "-march=native", "-ffp-contract=off", "-fno-math-errno"]
        if platform.machine() in ("x86_64", "AMD64"):
            flags.append("-mprefer-vector-width=512")
        with _BuildLock(cpp_extension._get_build_directory(name, verbose=False)):
            return cpp_extension.load(
                name=name,
                sources=[str(source)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # compiler missing, headers missing, build error
        raise KernelUnavailable(
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        ) from exc


def warm_up() -> list[str]:
    """Load both kernels now (building them if needed, once per environment), so that digests and
    the delta codec take them (``loaded()``, ``loaded_delta()``); returns why each that cannot be
    had is missing (the torch paths, the same bits, stay in use for it)."""
    missing = []
    for build in (load, load_delta):
        try:
            build()
        except KernelUnavailable as exc:
            missing.append(f"{build.__name__}: {exc}")
    return missing


def warm_up_in_background() -> None:
    """``warm_up`` on a daemon thread, so a process that only needs the kernels for speed, such as
    a vLLM worker computing digests, never waits for a compile; ``loaded()`` returns it once
    ready."""
    import threading

    threading.Thread(target=warm_up, name="dist-sr-kernel-build", daemon=True).start()


def loaded() -> ModuleType | None:
    """The kernel if this process has already built or loaded it, else None (never builds: for
    paths such as digests inside a vLLM worker, which must not stall on a first compile)."""
    return _if_loaded(load)


def loaded_delta() -> ModuleType | None:
    """The delta codec's kernel if already built or loaded in this process, else None (never
    builds: a receiver applies deltas with the torch reference, the same bytes, meanwhile)."""
    return _if_loaded(load_delta)


def _if_loaded(build) -> ModuleType | None:
    if build.cache_info().currsize == 0:  # not built in this process yet (or still building)
        return None
    try:
        return build()
    except KernelUnavailable:
        return None


class CPUBackend:
    """Rounds CPU tensors with the compiled kernel: one OpenMP pass, one hash per 4 elements."""

    name, device_keys, shaped = "cpu", False, False  # see numerics.backends.Backend
    auto_devices: tuple[str, ...] = ("cpu",)

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
            kernel.round_tensors(
                [batch.xs[i] for i in flat],
                [batch.outs[i] for i in flat],
                keys is not None,
                [] if keys is None else keys[flat].tolist(),
                [batch.offsets[i] for i in flat],
            )

    def adamw_step(self, plan, idx, grads, hypers, slots, keys, grad_scale, device_step=None) -> None:
        if device_step is not None:
            raise ValueError("steps derived on the device need the Triton backend")
        kernel = load()
        for (pure, _, scale), sel in plan.groups(idx, hypers, slots, grad_scale).items():
            flat = [plan.flat[i] for i in sel]
            consts = [v for i in sel for v in constants(hypers[slots[i]])]
            k = np.zeros(3 * len(sel), dtype=np.int64) if keys is None else keys[:, sel].T.reshape(-1)
            kernel.adamw_many(
                [f[0] for f in flat],
                [f[1] for f in flat],
                [f[2] for f in flat],
                [grads[i].reshape(-1) for i in sel],
                [] if pure else [f[3] for f in flat],
                keys is not None,
                k.tolist(),
                [plan.pieces[i].offset for i in sel],
                consts,
                float(grad_scale) if scale is None else scale,
            )


BACKEND = CPUBackend()
