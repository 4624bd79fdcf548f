"""The comparison's CPU pin: its workers compute with the pinned instruction set, the warm-up cache
tells pinned from unpinned checkpoints, and a pin that cannot take is refused."""

from __future__ import annotations

import os

import pytest
import torch

from dist_sr.rl.compare.config import CompareConfig
from dist_sr.rl.compare.runner import worker_pool
from dist_sr.rl.config import ConfigError, load_experiment
from dist_sr.rl.cpu_math import ISAS, check_pin_took, cpu_flags, pinned, pinned_isa, resolve_isa
from dist_sr.rl.warmup import cache_key

NATIVE = torch.backends.cpu.get_cpu_capability().lower()
FLAGS = cpu_flags()


def test_pinned_sets_and_restores_the_environment(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    before = dict(os.environ)
    with pinned("avx2"):
        assert {k: os.environ[k] for k in ISAS["avx2"]} == ISAS["avx2"] and pinned_isa() == "avx2"
    assert dict(os.environ) == before and pinned_isa() is None
    with pinned(None):
        assert dict(os.environ) == before


def test_unknown_isa_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"cpu_isa must be 'auto', one of \['avx2', 'avx512'\] or null"):
        CompareConfig(cpu_isa="sse4")
    assert CompareConfig().cpu_isa is None and CompareConfig(cpu_isa="auto").cpu_isa == "auto"
    # auto pins AVX2 where an x86-64 CPU has it and nothing elsewhere
    assert resolve_isa("auto") == ("avx2" if "avx2" in FLAGS else None) and resolve_isa("avx512") == "avx512"


def test_warmup_cache_tells_pinned_from_unpinned(monkeypatch):
    for name in ISAS["avx2"]:
        monkeypatch.delenv(name, raising=False)
    cfg = load_experiment({})
    unpinned, gpu = cache_key(cfg, "cpu"), cache_key(cfg, "cuda")
    with pinned("avx2"):
        avx2 = cache_key(cfg, "cpu")
        assert cache_key(cfg, "cuda") == gpu  # a GPU warm-up's name has no CPU pin in it
    with pinned("avx512"):
        avx512 = cache_key(cfg, "cpu")
    assert len({unpinned, avx2, avx512}) == 3 and cache_key(cfg, "cpu") == unpinned


def _worker_view() -> tuple[str, dict[str, str | None]]:
    return torch.backends.cpu.get_cpu_capability(), {name: os.environ.get(name) for name in ISAS["avx2"]}


def test_the_workers_compute_with_the_pinned_isa():
    """Every library's variable reaches the workers and ATen's kernels follow it. On an AVX-512
    machine the pinned workers also run narrower kernels than unpinned ones; on an AVX2-only one
    (no narrower set to show) the variables alone tell a pinned worker from an unpinned one."""
    with worker_pool(CompareConfig(parallel=1, cpu_isa="auto")) as pool:
        assert pool.submit(_worker_view).result() == ("AVX2", ISAS["avx2"])
    with worker_pool(CompareConfig(parallel=1, cpu_isa=None)) as pool:
        capability, env = pool.submit(_worker_view).result()
    assert capability == NATIVE.upper() and env != ISAS["avx2"]


def test_a_pin_that_did_not_take_is_refused(monkeypatch):
    # this process started unpinned: its kernels run the CPU's widest set, so pin another
    other = "avx512" if NATIVE == "avx2" else "avx2"
    for name, value in ISAS[other].items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"cpu_isa '{other}': this process's kernels run {NATIVE.upper()}"):
        check_pin_took()
