"""Start checkpoints of a pretrained model: its BF16 cast warmed up on the task's right answers,
one checkpoint per warm-up seed, cached, saved on the BF16 grid."""

import json

import pytest
import torch

from dist_sr.config import ConfigError
from dist_sr.rl.config import load_experiment


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    pytest.importorskip("gguf", reason="the gguf package (bash scripts/setup.sh rl smollm2 dev)")
    from .gguf_files import tiny_llama, write_gguf

    return write_gguf(tiny_llama(), tmp_path_factory.mktemp("model") / "tiny.gguf")


def experiment(gguf, tmp_path, **warmup):
    w = {
        "pretrained": True,
        "distractor_fraction": 0.0,
        "target_accuracy": 1.0,  # out of reach of a random model: it trains max_steps
        "max_steps": 2,
        "batch_size": 4,
        "lr": 1e-3,
        "eval_every": 1,
        "eval_prompts": 4,
        "cache_dir": str(tmp_path / "cache"),
        **warmup,
    }
    return load_experiment(
        {
            "model": {"path": str(gguf)},
            "task": {"name": "chat-add", "num_digits": 1},
            "warmup": w,
            "grpo": {"max_new_tokens": 4},
        }
    )


def test_each_warm_up_seed_gives_its_own_bf16_start_checkpoint_trained_from_the_cast_and_cached(gguf, tmp_path):
    from safetensors.torch import load_file

    from dist_sr.rl.checkpoint import bf16_start
    from dist_sr.rl.warmup import start_checkpoint, start_ready

    cfgs = [experiment(gguf, tmp_path, seed=s) for s in (0, 1)]
    assert not start_ready(cfgs[0])
    paths = [start_checkpoint(c, progress=False) for c in cfgs]
    assert paths[0] != paths[1] and all(start_ready(c) for c in cfgs)
    record = json.loads((tmp_path / "cache" / paths[0].split("/")[-1] / "warmup.json").read_text())
    assert record["steps"] == 2 and [s for s, _ in record["history"]] == [0, 1, 2]
    cast = load_file(str(bf16_start(str(gguf), tmp_path / "cache") / "model.safetensors"))
    a, b = (load_file(f"{p}/model.safetensors") for p in paths)
    assert all(t.dtype == torch.bfloat16 for t in a.values())  # on the BF16 grid, as a release is
    assert any(not torch.equal(a[k], cast[k]) for k in a)  # trained from the cast
    assert any(not torch.equal(a[k], b[k]) for k in a)  # another seed, another checkpoint
    mtime = (tmp_path / "cache" / paths[0].split("/")[-1] / "model.safetensors").stat().st_mtime_ns
    assert start_checkpoint(cfgs[0], progress=False) == paths[0]  # cached: not trained again
    assert (tmp_path / "cache" / paths[0].split("/")[-1] / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_warm_up_that_starts_at_its_target_keeps_the_casts_weights(gguf, tmp_path):
    from safetensors.torch import load_file

    from dist_sr.rl.checkpoint import bf16_start
    from dist_sr.rl.warmup import start_checkpoint

    path = start_checkpoint(experiment(gguf, tmp_path, target_accuracy=0.0), progress=False)
    cast = load_file(str(bf16_start(str(gguf), tmp_path / "cache") / "model.safetensors"))
    warmed = load_file(f"{path}/model.safetensors")
    assert json.loads(open(f"{path}/warmup.json").read())["steps"] == 0
    assert all(torch.equal(warmed[k], cast[k]) for k in cast)


def test_distractors_and_a_warm_up_without_a_checkpoint_are_refused(gguf, tmp_path):
    from dist_sr.rl.warmup import start_checkpoint

    with pytest.raises(ConfigError, match="warmup.distractor_fraction=0.7: the warm-up of a pretrained model"):
        start_checkpoint(experiment(gguf, tmp_path, distractor_fraction=0.7), progress=False)
    with pytest.raises(ConfigError, match="warmup.pretrained warms up the checkpoint of model.path"):
        load_experiment({"warmup": {"pretrained": True}})


def test_a_comparison_of_a_warmed_up_pretrained_model_may_have_several_start_checkpoints(gguf, tmp_path):
    from dist_sr.rl.compare import cells, load_compare, run_config

    exp = {"model": {"path": str(gguf)}, "task": {"name": "chat-add"}, "warmup": {"pretrained": True}}
    cfg = load_compare(None, {"experiment": exp, "start_seeds": [0, 1], "output_dir": str(tmp_path)})
    assert [run_config(cfg, cells(cfg)[0], s, 0).warmup.seed for s in (0, 1)] == [0, 1]
    with pytest.raises(ConfigError, match="warm the checkpoint up \\(warmup.pretrained: true\\)"):
        load_compare(None, {"experiment": {**exp, "warmup": {}}, "start_seeds": [0, 1]})
