"""What the GPU will run, checked without a GPU: every Triton kernel compiles for sm_90 (H100/H200)
with the launch options the code uses, full blocks of aligned launches move 16 bytes per access,
and the arithmetic that must equal the CPU's bits compiles to correctly rounded operations with
no fused multiply-add (and the control, compiled with contraction allowed, does fuse: the option
is what keeps the bits). Compiled in a fresh process: Triton's interpreter, which the CPU tests
use, replaces the compiled kernels at import."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("ptx") / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ptx_report.py"), "--json", str(out), "--no-registers"],
        check=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=600,
    )
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_sm90(report):
    assert len(report) >= 20
    assert all(v["accesses"] for v in report.values())


@pytest.mark.slow
def test_aligned_launches_move_16_bytes_per_access_and_misaligned_ones_never_assume_it(report):
    for name, v in report.items():
        if "aligned=True" in name and "moments_bf16=True" not in name or name.startswith("sr_one"):
            assert v["accesses"].get("ld.global.v4.b32", 0) > 0, name
        if "aligned=False" in name:
            assert "ld.global.v4.b32" not in v["accesses"], name


@pytest.mark.slow
def test_adamw_and_key_derivation_compile_to_exact_ieee_operations(report):
    for name, v in report.items():
        if name.startswith("adamw_many pure"):
            assert "fma.rn.f32" not in v["arithmetic"], name
            assert {"div.rn.f32", "sqrt.rn.f32"} <= set(v["arithmetic"]), name
    keys = report["step_data (device keys)"]["arithmetic"]
    assert {"div.rn.f64", "sqrt.rn.f64"} <= set(keys) and "fma.rn.f64" not in keys
    assert "fma.rn.f32" in report["adamw_many shadow, contraction allowed (control)"]["arithmetic"]
