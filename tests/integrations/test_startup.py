"""The integrations' own plug points (verl's ``external_lib``, OpenRLHF's start-up, TRL's
``enable``) refuse to turn SR on in a process that imported DeepSpeed without dist-sr's start-up
hook, naming why the hook is not in force and the fix. Each runs in a fresh process whose hook was
taken off ``sys.meta_path`` before DeepSpeed was imported (real DeepSpeed, unpatched); the installs
where the hook never runs (``pip install --target``, zipapps, ...) are ``tests/launch/test_doctor.py``."""

import os
import subprocess
import sys

import pytest

from tests.dist_utils import REPO, free_port

pytest.importorskip("deepspeed")
UNHOOKED = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_Finder']; import deepspeed\n"
)

TRL = """
import torch
from transformers import Trainer, TrainingArguments
from tests.engines.models import tiny_qwen2
from dist_sr.integrations import trl

ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
      "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}
args = TrainingArguments(output_dir="out", per_device_train_batch_size=2, max_steps=1, bf16=True, deepspeed=ds,
                         report_to=[], save_strategy="no", use_cpu=True)
ids = torch.zeros(3, dtype=torch.long)
trl.enable(Trainer(model=tiny_qwen2(), args=args, train_dataset=[{"input_ids": ids, "labels": ids}]), seed=5)
"""


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "DIST_SR_SEED": "5"}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return subprocess.run(
        [sys.executable, "-c", UNHOOKED + code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def _refused(r: subprocess.CompletedProcess, asked_by: str) -> None:
    assert r.returncode != 0, r.stdout[-2000:]
    said = r.stderr
    assert "DeepSpeedUnpatched" in said and f"{asked_by} asks for keyed SR" in said, said[-3000:]
    assert "deepspeed.initialize is DeepSpeed's own" in said and "not registered in this process" in said, said[-3000:]
    assert "dist_sr_deepspeed_hook.register()" in said  # the fix


def test_verl_and_openrlhf_refuse_sr_where_deepspeed_was_imported_without_the_hook(tmp_path):
    _refused(_run("import dist_sr.integrations.verl", tmp_path), "external_lib=dist_sr.integrations.verl")
    _refused(_run("from dist_sr.integrations import openrlhf; openrlhf.enable()", tmp_path), "(OpenRLHF's start-up)")


def test_trl_enable_refuses_sr_where_deepspeed_was_imported_without_the_hook(tmp_path):
    _refused(_run(TRL, tmp_path), "dist_sr.integrations.trl.enable(trainer)")
