"""GRPO training end to end on real tiny transformers models, under every precision."""

import copy
import json
import math

import pytest
import torch

from dist_sr import PRECISIONS
from dist_sr.rl.model import load_pretrained
from dist_sr.rl.trainer import RolloutWeightMismatch, train
from dist_sr.rl.warmup import cache_key, warmup_checkpoint
from dist_sr.rollout.embedded import EmbeddedEngine


def metrics(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_learns_and_rolls_out_with_the_training_weights(precision, easy):
    cfg = easy(precision=precision)
    assert cfg.rollout.verify_every == 1  # every step: rollout digest == trainer digest, or it raises
    rows = metrics(train(cfg, progress=False))
    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    assert evals[-1] >= evals[0] + 0.25, evals
    steps = [r for r in rows if "reward" in r]
    assert [r["weight_version"] for r in steps] == list(range(len(steps)))
    skipped = [r for r in steps if r["skipped"]]
    assert not any(r["nonfinite"] for r in steps)
    if cfg.precision.spec.loss_scaling:
        # FP16's dynamic loss scaler (from 2^16) skips a step whose scaled gradients overflowed and
        # halves its scale; when that happens depends on the run's arithmetic (it differs between
        # CPUs), so a skip is allowed, but only as an overflow: no gradient norm was taken
        assert all(r["grad_norm"] is None or not math.isfinite(r["grad_norm"]) for r in skipped), skipped
    else:
        assert not skipped, skipped


def test_rollouts_from_other_weights_are_caught(easy):
    cfg = easy(precision="bf16-sr")

    def stale_engine(model, tokenizer):
        stale = copy.deepcopy(model)
        with torch.no_grad():
            stale.lm_head.weight.view(torch.int16)[0, 0] ^= 1  # one bit off
        return EmbeddedEngine(stale, tokenizer)

    with pytest.raises(RolloutWeightMismatch, match="step 1"):
        train(cfg, progress=False, make_engine=stale_engine)


def test_resuming_continues_the_same_metric_curve(easy, tmp_path):
    straight = metrics(
        train(easy(precision="bf16-sr", output_dir=str(tmp_path / "a"), **{"grpo.steps": 10}), progress=False)
    )
    cfg = easy(precision="bf16-sr", output_dir=str(tmp_path / "b"), **{"grpo.steps": 10})
    train(cfg, progress=False, stop_at=4)
    resumed = metrics(train(cfg, progress=False, resume=True))
    drop = lambda rows: [{k: v for k, v in r.items() if k != "step_time"} for r in rows]  # noqa: E731
    assert drop(resumed) == drop(straight)


def test_warmup_checkpoint_is_on_the_bf16_grid_and_loads_with_from_pretrained(easy):
    cfg = easy()
    path = warmup_checkpoint(cfg, progress=False)
    model, tokenizer = load_pretrained(path)
    for name, p in model.named_parameters():
        assert torch.equal(p, p.to(torch.bfloat16).float()), name
    assert tokenizer.decode(tokenizer("123=")["input_ids"]) == "123="
    assert warmup_checkpoint(cfg, progress=False) == path  # cached
    # the cache is per kind of device: a GPU warm-up (other kernels, other bits) is not this one
    assert path.name == f"warmup-{cache_key(cfg, 'cpu')}" and cache_key(cfg, "cuda") != cache_key(cfg, "cpu")


def test_train_from_a_local_pretrained_directory(easy, tmp_path):
    path = warmup_checkpoint(easy(), progress=False)
    cfg = easy(precision="bf16", **{"model.path": str(path), "grpo.steps": 2, "warmup.enabled": False})
    rows = metrics(train(cfg, progress=False))
    assert rows[-1]["step"] == 2


def test_metrics_go_to_jsonl_and_tensorboard(easy, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = train(easy(precision="bf16-sr", **{"grpo.steps": 3, "eval.every": 3}), progress=False)
    rows = metrics(path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    events = EventAccumulator(str(path.parent / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"reward", "eval_accuracy", "kl_k3", "changed_frac"} <= tags
    assert [e.value for e in events.Scalars("reward")] == pytest.approx([r["reward"] for r in rows[1:]])
