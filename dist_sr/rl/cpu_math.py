"""Pinning the CPU's numeric kernels to one instruction set (a comparison's ``cpu_isa``, off by
default), for a run that must give the same bits on CPUs of another width.

MKL (torch's BLAS), oneDNN and ATen's vectorised kernels each pick the widest instruction set the
CPU offers, and their FP32 sums differ between AVX2 and AVX-512: the quickstart's first warm-up
reaches its target at step 700 on an AVX-512 Xeon and at step 825 with the kernels pinned to AVX2.
The pin costs: pinned to AVX2, that Xeon's BF16 and FP16 steps took 4.7x and 4.8x as long (no
AMX or AVX-512 BF16/FP16), FP32 1.02-1.15x. The libraries read their choice from the environment
when they first run, so the pin is for processes that have not computed anything yet: the
comparison's workers, which it starts with ``spawn`` inside :func:`pinned`."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager

from ..config import ConfigError

# the variable each library reads, and its spelling of each instruction set
ISAS: dict[str, dict[str, str]] = {
    "avx2": {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"MKL_CBWR": "AVX512", "ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
}


def check_isa(isa: str | None) -> None:
    """Refuses an instruction set we cannot pin, naming the choices."""
    if isa is not None and isa != "auto" and isa not in ISAS:
        raise ConfigError(f"cpu_isa must be 'auto', one of {sorted(ISAS)} or null (the CPU's widest), got {isa!r}")


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` of /proc/cpuinfo (None where there is none: not Linux, or no such field)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), None)
    except OSError:
        return None


def cpu_flags() -> set[str]:
    return set((_cpuinfo("flags") or "").split())


def resolve_isa(isa: str | None) -> str | None:
    """``auto``: AVX2 on an x86-64 CPU that has it (most machines since 2015), else unpinned
    (an ARM machine's kernels are not ours to pin)."""
    check_isa(isa)
    if isa != "auto":
        return isa
    return "avx2" if platform.machine().lower() in ("x86_64", "amd64") and "avx2" in cpu_flags() else None


@contextmanager
def pinned(isa: str | None) -> Iterator[None]:
    """Within the block, processes started from this one compute with ``isa`` (None: unpinned,
    the environment as it is; ``auto``: see :func:`resolve_isa`). The previous environment comes
    back afterwards."""
    isa = resolve_isa(isa)
    if isa is None:
        yield
        return
    saved = {name: os.environ.get(name) for name in ISAS[isa]}
    os.environ.update(ISAS[isa])
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def pinned_isa() -> str | None:
    """The instruction set this process's environment pins (None when it pins none of ours)."""
    for isa, env in ISAS.items():
        if all(os.environ.get(name) == value for name, value in env.items()):
            return isa
    return None


def check_pin_took() -> None:
    """In a worker started inside :func:`pinned`: refuses to compute when ATen's kernels do not
    run the pinned instruction set (a CPU without it falls back to a narrower one)."""
    isa = pinned_isa()
    if isa is None:
        return
    import torch

    got = torch.backends.cpu.get_cpu_capability()
    if got.lower() != isa:
        raise ConfigError(
            f"cpu_isa {isa!r}: this process's kernels run {got}, so the CPU lacks {isa.upper()}; "
            "set cpu_isa to one it has, or null, in the comparison config"
        )


def machine() -> str:
    """The CPU and the numeric libraries of this process, for a report to say where it came from."""
    import torch
    import transformers

    model = _cpuinfo("model name") or platform.processor() or platform.machine()
    return (
        f"{model} (torch's widest kernels here: {torch.backends.cpu.get_cpu_capability()}); "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )


# How a run's BF16 and FP16 matrix products are computed on the CPU (``cpu_matmul``):
#   native: torch's own kernels. On a CPU without BF16/FP16 matrix units (no AVX512_BF16 or AMX;
#     AVX512_FP16 for FP16) they take a scalar fallback: a SmolLM2-135M forward and backward ran
#     7.5x (BF16) and 18x (FP16) slower than with fp32-accumulate on a 2-core AVX2 EPYC
#     (bench/cpu_matmul.py).
#   fp32-accumulate: each product of BF16 (FP16) operands computed as an FP32 GEMM of the widened
#     operands (exact: every BF16/FP16 value is an FP32 value), its result rounded once to the
#     operands' dtype: what BF16/FP16 matrix units do (FP32 accumulation, one rounding of the
#     output). Weights, activations and gradients stay in the working dtype between products.
CPU_MATMULS = ("native", "fp32-accumulate")


def check_cpu_matmul(name: str) -> None:
    if name not in CPU_MATMULS:
        raise ConfigError(
            f"cpu_matmul must be one of {list(CPU_MATMULS)} (native: torch's kernels; fp32-accumulate: "
            f"BF16/FP16 products as FP32 GEMMs rounded once, for CPUs without BF16/FP16 units), got {name!r}"
        )


def _products() -> frozenset:
    import torch
    import torch.nn.functional as F

    return frozenset(
        {
            F.linear,
            F.scaled_dot_product_attention,
            torch.matmul,
            torch.mm,
            torch.bmm,
            torch.addmm,
            torch.baddbmm,
            torch.Tensor.matmul,
            torch.Tensor.__matmul__,
            torch.Tensor.mm,
            torch.Tensor.bmm,
        }
    )


def _fp32_accumulate_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    low = (torch.bfloat16, torch.float16)
    products = _products()

    class Fp32Accumulate(TorchFunctionMode):
        """BF16/FP16 products on the CPU as FP32 GEMMs of the widened operands, rounded once."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if func not in products or first is None or first.device.type != "cpu" or first.dtype not in low:
                return func(*args, **kwargs)
            dtype = first.dtype

            def widen(a):
                return a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a

            out = func(*[widen(a) for a in args], **{k: widen(v) for k, v in kwargs.items()})
            return out.to(dtype)

    return Fp32Accumulate()


@contextmanager
def cpu_matmul(name: str) -> Iterator[None]:
    """Within the block (this thread), BF16/FP16 products on the CPU are computed as ``name`` says
    (``CPU_MATMULS``); autograd records the widening and the rounding, so a product's gradients are
    FP32 GEMMs rounded once to the working dtype as well."""
    check_cpu_matmul(name)
    if name == "native":
        yield
        return
    with _fp32_accumulate_mode():
        yield
