"""GRPO on DeepSpeed and FSDP2 engines: 2 ranks on gloo, real engines, the easy task."""

import json
import os
import shutil

import pytest

from tests.dist_utils import run_workers
from tests.rl.conftest import EASY

pytestmark = pytest.mark.slow


def _train_worker(rank, world_size, data):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dist_sr.rl.config import load_experiment
    from dist_sr.rl.trainer import train

    cfg = load_experiment(data)
    train(cfg, progress=False)


@pytest.mark.parametrize(
    "distributed",
    [
        {"engine": "deepspeed", "zero_stage": 2},
        {"engine": "deepspeed", "zero_stage": 3},
        {"engine": "fsdp2", "fsdp2": {"shard_modules": ["Qwen2DecoderLayer"]}},
    ],
    ids=["zero2", "zero3", "fsdp2"],
)
def test_distributed_grpo_learns_with_rollouts_on_the_training_bits(distributed, warmup_cache, tmp_path):
    data = {k: dict(v) for k, v in EASY.items()}
    data["warmup"]["cache_dir"] = warmup_cache
    data.update(output_dir=str(tmp_path / "run"), precision="bf16-sr", distributed=distributed)
    run_workers(_train_worker, 2, data)  # rollout.verify_every=1: every step checks the weight digest
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    assert rows[-1]["step"] == EASY["grpo"]["steps"]
    assert evals[-1] >= evals[0] + 0.2, evals


def _resume_worker(rank, world_size, data, straight_dir, resumed_dir):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dist_sr.rl.config import load_experiment
    from dist_sr.rl.trainer import train

    train(load_experiment(data, {"output_dir": straight_dir}), progress=False)
    cfg = load_experiment(data, {"output_dir": resumed_dir})
    train(cfg, progress=False, stop_at=4)
    train(cfg, progress=False, resume=True)


def _metrics(path):
    return [{k: v for k, v in json.loads(line).items() if k != "step_time"} for line in open(path / "metrics.jsonl")]


@pytest.mark.parametrize(
    "distributed, precision",
    [
        ({"engine": "deepspeed", "zero_stage": 2}, "bf16-sr"),
        ({"engine": "fsdp2", "fsdp2": {"shard_modules": ["Qwen2DecoderLayer"]}}, "bf16-sr"),
        (
            {"engine": "fsdp2", "fsdp2": {"shard_modules": ["Qwen2DecoderLayer"]}},
            {"precision": "bf16-pure-sr", "moment_dtype": "bf16"},
        ),
    ],
    ids=["zero2", "fsdp2", "fsdp2-pure-bf16"],
)
def test_run_resumes_on_the_same_metric_curve(distributed, precision, warmup_cache, tmp_path):
    """Stopped after step 4 and resumed, a run logs exactly the uninterrupted run's metrics."""
    data = {k: dict(v) for k, v in EASY.items()}
    data["warmup"]["cache_dir"] = warmup_cache
    data["grpo"]["steps"] = 8
    data.update(precision=precision, distributed=distributed, checkpoint_every=4)  # saves at 4 and 8, once each
    run_workers(_resume_worker, 2, data, str(tmp_path / "a"), str(tmp_path / "b"))
    assert _metrics(tmp_path / "b") == _metrics(tmp_path / "a")
    root = tmp_path / "b" / distributed["engine"]
    ckpts = sorted(p.name for p in root.iterdir() if p.name.startswith(("step", "latest")))
    assert ckpts == ["latest", "step4", "step8"], ckpts  # two kept, no temporaries left


def _reshard_worker(rank, world_size, data, run_dir):
    from dist_sr.rl.config import load_experiment
    from dist_sr.rl.trainer import train

    train(load_experiment(data, {"output_dir": run_dir}), progress=False, resume=True, stop_at=5)


def test_fsdp2_checkpoint_resumes_at_another_world_size(warmup_cache, tmp_path):
    """Saved by 2 ranks, loaded by 1 and by 4: ``load`` checks that the BF16 working weights
    re-derived from the resharded masters have the digest recorded at save time."""
    data = {k: dict(v) for k, v in EASY.items()}
    data["warmup"]["cache_dir"] = warmup_cache
    data["grpo"]["steps"] = 8
    data.update(precision="bf16-sr", distributed={"engine": "fsdp2", "fsdp2": {"shard_modules": ["Qwen2DecoderLayer"]}})
    run_workers(_train_worker, 2, {**data, "output_dir": str(tmp_path / "a"), "grpo": {**data["grpo"], "steps": 4}})
    for world in (1, 4):
        run_dir = tmp_path / f"w{world}"
        shutil.copytree(tmp_path / "a", run_dir)
        run_workers(_reshard_worker, world, data, str(run_dir))
        rows = _metrics(run_dir)
        assert [r["step"] for r in rows][-2:] == [4, 5]
        assert rows[:-1] == _metrics(tmp_path / "a")


def test_fsdp2_checkpoint_whose_weights_changed_is_refused(warmup_cache, tmp_path):
    data = {k: dict(v) for k, v in EASY.items()}
    data["warmup"]["cache_dir"] = warmup_cache
    data["grpo"]["steps"] = 2
    data.update(precision="bf16-sr", distributed={"engine": "fsdp2", "fsdp2": {"shard_modules": ["Qwen2DecoderLayer"]}})
    run_workers(_train_worker, 2, {**data, "output_dir": str(tmp_path / "a")})
    meta_path = tmp_path / "a" / "fsdp2" / "step2" / "dist_sr.json"
    meta = json.loads(meta_path.read_text())
    meta["sr"]["step"] += 1  # the masters would round with another step's bits
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(AssertionError, match=r"files differ from those written: \['dist_sr.json'\]"):
        run_workers(_reshard_worker, 1, {**data, "grpo": {**data["grpo"], "steps": 3}}, str(tmp_path / "a"))
    # with the manifest rewritten to match (a writer that recorded the wrong step), the digest
    # of the re-derived weights still refuses it
    from dist_sr.engines.checkpoints import write_manifest

    write_manifest(meta_path.parent)
    with pytest.raises(AssertionError, match="working weights re-derived from the loaded masters have digest"):
        run_workers(_reshard_worker, 1, {**data, "grpo": {**data["grpo"], "steps": 3}}, str(tmp_path / "a"))


def _nonfinite_worker(rank, world_size, data, out):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dist_sr.rl.config import load_experiment
    from dist_sr.rl.trainer import NonFiniteTraining, train

    try:
        train(load_experiment(data), progress=False)
        message = "finished"
    except NonFiniteTraining as exc:
        message = str(exc)
    with open(f"{out}.{rank}", "w") as f:
        f.write(message)


def test_deepspeed_bf16_never_steps_on_a_non_finite_loss(warmup_cache, tmp_path):
    """ZeRO-2 in BF16 has no loss scaler to skip bad steps: the trainer must, on every rank
    together, before DeepSpeed applies anything; three in a row stop the run, nothing is saved."""
    data = {k: dict(v) for k, v in EASY.items()}
    data["warmup"]["cache_dir"] = warmup_cache
    data["grpo"].update(steps=12, lr=1e30)
    data.update(
        output_dir=str(tmp_path / "run"),
        precision="bf16-sr",
        checkpoint_every=0,
        distributed={"engine": "deepspeed", "zero_stage": 2},
    )
    run_workers(_nonfinite_worker, 2, data, str(tmp_path / "outcome"))
    for rank in (0, 1):
        assert "steps 2..4 had a non-finite loss or gradient" in (tmp_path / f"outcome.{rank}").read_text()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [(r["step"], r["nonfinite"], r["skipped"]) for r in rows[1:]] == [
        (1, False, False),
        (2, True, True),
        (3, True, True),
        (4, True, True),
    ]
    assert not (tmp_path / "run" / "deepspeed").exists()
