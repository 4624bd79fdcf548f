"""TRL's GRPOTrainer with keyed SR through ``dist_sr.integrations.trl`` (real TRL from PyPI, real
DeepSpeed, gloo): what TRL hands its vLLM push is the keyed SR of the full FP32 masters, bitwise;
reference models stay as loaded; the SR metrics reach TRL's loggers."""

import json
import subprocess

import pytest

from tests.dist_utils import REPO, free_port, launcher_env

pytest.importorskip("trl")
pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow


def run_example(tmp_path, nproc: int, *args: str) -> dict:
    out = tmp_path / "result.json"
    cmd = [
        "torchrun",
        "--nproc-per-node",
        str(nproc),
        f"--master-port={free_port()}",
        str(REPO / "tests" / "integrations" / "trl_run.py"),
        str(out),
        "--output-dir",
        str(tmp_path / "run"),
        *args,
    ]
    r = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**launcher_env(), "DIST_SR_DEEPSPEED_HOOK": "1"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(out.read_text())


def check_trained(result: dict, steps: int):
    assert result["steps"] == steps and result["attached"] and result["names"] and result["moved"]
    assert result["keyed"]  # every tensor TRL would push equals stochastic_round(full master), bitwise
    assert result["logged"] == ["dist_sr/key_step", "dist_sr/unfollowed_frac"]
    # SR follows the masters' movement in expectation: the unfollowed share is ~0 (its noise here,
    # ~ulp / (2 |dS| sqrt(N)) over ~50k elements moved ~1e-3 each, is below 0.01; RTN that sticks gives ~1)
    assert len(result["unfollowed"]) == steps - 1 and all(abs(f) < 0.05 for f in result["unfollowed"])


def test_grpo_zero2_two_ranks_pushes_the_keyed_bits(tmp_path):
    result = run_example(tmp_path, 2, "--zero-stage", "2", "--steps", "3")
    check_trained(result, 3)
    # the metrics went through TRL's report_to (TensorBoard): an event file with the SR scalars
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = [p for p in (tmp_path / "run").rglob("events.out.tfevents.*")]
    assert events
    tags = set()
    for e in events:
        acc = EventAccumulator(str(e))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"train/dist_sr/unfollowed_frac", "train/dist_sr/key_step"} <= tags


def test_grpo_zero3_with_a_reference_model_pushes_the_keyed_bits(tmp_path):
    result = run_example(tmp_path, 1, "--zero-stage", "3", "--beta", "0.1", "--steps", "3")
    check_trained(result, 3)
    assert result["ref_as_loaded"] and not result["ref_attached"]  # the optimizer-less reference engine: untouched


def _fsdp2_worker(rank, world_size):
    """accelerate turns FSDP on only for accelerator devices (its state keeps CPU ranks on DDP),
    so GRPOTrainer cannot run FSDP2 here. This runs the same pieces on real FSDP2 over gloo:
    ``prepare_fsdp2`` on accelerate's real FSDP2 plugin, ``fully_shard`` with the policy it set
    (what accelerate's ``fsdp2_prepare_model`` passes), the callback's ``on_train_begin``, and
    TRL's own FSDP2 export (``_iter_fsdp2_params``: ``param.full_tensor()``, the FP32 masters)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import fully_shard
    from transformers import TrainerState
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    from dist_sr import stochastic_round
    from dist_sr.engines import fsdp2
    from dist_sr.engines.fsdp2.source import reshard_all
    from dist_sr.integrations import trl as dsr_trl
    from tests.engines.models import tiny_qwen2
    from tests.engines.test_fsdp2 import capture_working, train

    model = tiny_qwen2().to(torch.bfloat16)  # loaded in BF16, as "auto" dtype would: upcast to FP32 masters
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    ctx = dsr_trl.prepare_fsdp2(model, plugin, seed=77)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=plugin.mixed_precision_policy)
    fully_shard(model, mp_policy=plugin.mixed_precision_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    class Trainer:  # what the callback reads of the trainer
        model_wrapped = model
        accelerator = Accelerator(cpu=True)

    trainer = Trainer()
    callback = dsr_trl.DistSRCallback(trainer, "fsdp2", ctx)
    callback.on_train_begin(None, TrainerState(global_step=0), None, optimizer=opt)
    train(model, opt, 3)
    masters = fsdp2.full_master(model)
    expected = {n: stochastic_round(m, seed=77, step=3, param=n) for n, m in masters.items()}

    accelerator = Accelerator(cpu=True)
    gen = VLLMGeneration.__new__(VLLMGeneration)
    gen.model, gen.accelerator = model, accelerator
    gen._dist = DistributedBackend.__new__(DistributedBackend)
    gen._dist.zero_stage, gen._dist.fsdp_version = 0, 2  # what accelerate's FSDP2 state gives TRL

    def bits(t):
        return t.contiguous().view(torch.int16)

    plain_push = {n: t.clone() for n, t in gen._iter_named_params()}  # TRL as it is: FP32 masters
    rtn = sum(int((bits(t.to(torch.bfloat16)) != bits(expected[n])).sum()) for n, t in plain_push.items())
    assert all(t.dtype == torch.float32 for t in plain_push.values())
    assert rtn > 0.05 * sum(t.numel() for t in expected.values())  # vLLM's RTN cast would not hold the trainer's bits
    dsr_trl.route_vllm_exports(accelerator, callback)
    pushed = {n: t.clone() for n, t in gen._iter_named_params()}
    working = capture_working(model)
    assert sorted(pushed) == sorted(expected) == sorted(working)
    for n in expected:
        assert torch.equal(bits(pushed[n]), bits(expected[n])) and torch.equal(bits(working[n]), bits(expected[n])), n
    # AsyncGRPOTrainer streams full_tensor() masters from _streaming_iter, in its manifest's dtypes
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, _iter_vllm_named_params

    async_trainer = AsyncGRPOTrainer.__new__(AsyncGRPOTrainer)
    async_trainer.model, async_trainer.accelerator = model, accelerator
    reshard_all(model)  # the FP32 masters, as its __init__ sees the parameters (the forward above left them gathered)
    manifest = [(n, str(p.dtype).split(".")[-1]) for n, p in _iter_vllm_named_params(model)]  # as its __init__ does
    async_trainer.weight_transfer = type(
        "Client",
        (),
        {"_weight_update_info": {"names": [n for n, _ in manifest], "dtype_names": [d for _, d in manifest]}},
    )()
    streamed = {n: t.clone() for n, t in async_trainer._streaming_iter()}
    assert sorted(streamed) == sorted(expected)
    for n, d in manifest:  # the manifest's FP32, holding exactly the keyed BF16 values vLLM's cast keeps
        assert streamed[n].dtype == getattr(torch, d) == torch.float32, n
        assert torch.equal(bits(streamed[n].to(torch.bfloat16)), bits(expected[n])), n
        assert torch.equal(streamed[n], expected[n].float()), n
    assert callback.unfollowed_frac() is None  # the first call only takes the reference
    train(model, opt, 2)
    assert abs(callback.unfollowed_frac()) < 0.05  # SR follows the masters (RTN that sticks: ~1)
    # a resumed run continues the key from the restored step
    callback.on_train_begin(None, TrainerState(global_step=7), None, optimizer=opt)
    assert ctx.step == 7


def test_fsdp2_trl_export_pushes_the_keyed_bits_not_the_masters():
    from tests.dist_utils import run_workers

    run_workers(_fsdp2_worker, 2)
