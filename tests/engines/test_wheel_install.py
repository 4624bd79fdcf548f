"""``pip install dist-sr`` alone, as a Ray ``runtime_env``, a container image or a node set up by
hand installs it: the project's wheel, built and installed by pip into a fresh virtual
environment, and nothing else run. A job that calls plain ``deepspeed.initialize`` with
``DIST_SR_SEED`` set then trains with keyed SR, never silently round-to-nearest.

The fresh environment sees torch, DeepSpeed and transformers through a path entry to this
suite's packages (``tests/installs.py``); dist-sr itself comes only from the wheel: the test
first shows it cannot be imported there."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.dist_utils import free_port
from tests.installs import build_wheel, fresh_venv, pip

pytest.importorskip("deepspeed")

SEED = 4242
JOB = """
import json, os, sys
import deepspeed, torch
from transformers import Qwen2Config, Qwen2ForCausalLM

torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=5, hidden_size=24, intermediate_size=40, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                     initializer_range=0.25))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
ids = torch.randint(0, 5, (2, 9), generator=torch.Generator().manual_seed(7))
for _ in range(3):
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()

# the test's check, after the job: are the BF16 weights the keyed SR of their FP32 masters?
import dist_sr
from deepspeed.utils import safe_get_full_fp32_param
state = {n: (p.data.clone(), safe_get_full_fp32_param(p).view(p.shape)) for n, p in engine.module.named_parameters()}
keyed = all(torch.equal(w.view(torch.int16), dist_sr.stochastic_round(m, seed=int(os.environ.get("DIST_SR_SEED", "0")),
            step=engine.global_steps, param=n).view(torch.int16)) for n, (w, m) in state.items())
rtn = all(torch.equal(w, m.to(torch.bfloat16)) for w, m in state.values())
json.dump({"attached": hasattr(engine, "dist_sr"), "keyed": keyed, "rtn": rtn, "dist_sr": dist_sr.__file__},
          open(sys.argv[1], "w"))
"""


def _run_job(python: Path, tmp: Path, label: str, env_extra: dict) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / f"{label}.json"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "DIST_SR_", "PYTHONPATH"))
    }
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        **env_extra,
    )
    r = subprocess.run(
        [str(python), str(tmp / "job.py"), str(out)], cwd=tmp, env=env, capture_output=True, text=True, timeout=600
    )
    return r, out


@pytest.mark.slow
def test_pip_installing_the_wheel_alone_makes_DIST_SR_SEED_key_a_plain_deepspeed_job(tmp_path):
    wheel = build_wheel(tmp_path)
    python = fresh_venv(tmp_path / "fresh")
    absent = subprocess.run([str(python), "-c", "import dist_sr"], cwd=tmp_path, capture_output=True, text=True)
    assert absent.returncode != 0, "the fresh environment must not see the suite's editable dist-sr"
    pip(python, "install", str(wheel))  # pip itself, from this suite's environment, into the fresh one
    (tmp_path / "job.py").write_text(JOB)

    r, out = _run_job(python, tmp_path, "seed", {"DIST_SR_SEED": str(SEED)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dist_sr"].startswith(str(tmp_path / "fresh")), result  # the wheel's copy, not the checkout
    assert (result["attached"], result["keyed"], result["rtn"]) == (True, True, False), result
    assert f"seed {SEED}" in r.stderr  # the job's log says SR is on, and with which seed

    # the hook turned off while the job still asks for SR: refused before the first step, named
    r, out = _run_job(python, tmp_path, "off", {"DIST_SR_SEED": str(SEED), "DIST_SR_DEEPSPEED_HOOK": "0"})
    assert r.returncode != 0 and not out.exists()
    assert "DIST_SR_DEEPSPEED_HOOK='0'" in r.stderr and "round-to-nearest" in r.stderr, r.stderr[-3000:]

    # no SR asked for: the job is DeepSpeed's own, untouched
    r, out = _run_job(python, tmp_path, "plain", {})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(out.read_text())["rtn"] is True
