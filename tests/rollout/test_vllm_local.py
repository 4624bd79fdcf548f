"""Local engines (``rollout.vllm.local_python``): refused with the fix when misconfigured, before
anything starts."""

import pytest

from dist_sr.config import ConfigError
from dist_sr.rl.config import load_experiment
from dist_sr.rollout.vllm.local import LocalEngine


def test_local_engines_and_urls_together_are_refused():
    with pytest.raises(ConfigError, match="leave rollout.vllm.urls empty"):
        load_experiment(
            {"rollout": {"engine": "vllm", "vllm": {"local_python": "python", "urls": ["http://127.0.0.1:8000"]}}}
        )
    with pytest.raises(ConfigError, match="local_threads must be >= 1"):
        load_experiment({"rollout": {"vllm": {"local_python": "python", "local_threads": 0}}})


def test_a_local_engine_without_its_python_is_refused_naming_the_setup(tmp_path):
    with pytest.raises(ConfigError, match="scripts/setup_vllm.sh"):
        LocalEngine(tmp_path / "no-python", tmp_path, log=tmp_path / "engine.log")
