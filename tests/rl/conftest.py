import pytest

# A small, quick configuration: 3-digit reversal on a tiny Qwen2, learnable in ~20 GRPO steps.
EASY = {
    "model": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "initializer_range": 0.1},
    "task": {"name": "reverse", "num_digits": 3},
    "warmup": {
        "target_accuracy": 0.3,
        "max_steps": 400,
        "batch_size": 64,
        "lr": 1e-2,
        "eval_every": 20,
        "eval_prompts": 128,
    },
    "grpo": {"steps": 20, "prompts_per_step": 16, "samples_per_prompt": 4, "lr": 3e-3, "max_new_tokens": 4},
    "eval": {"every": 5, "num_prompts": 128},
}


@pytest.fixture(scope="session")
def warmup_cache(tmp_path_factory):
    """One warm-up checkpoint shared by every RL test of the session."""
    return str(tmp_path_factory.mktemp("warmup-cache"))


@pytest.fixture
def easy(warmup_cache, tmp_path):
    def make(**overrides):
        from dist_sr.rl.config import load_experiment

        data = {k: dict(v) for k, v in EASY.items()}
        data["warmup"]["cache_dir"] = warmup_cache
        data["output_dir"] = str(tmp_path / "run")
        return load_experiment(data, overrides)

    return make
