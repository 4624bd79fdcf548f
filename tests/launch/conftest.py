from pathlib import Path

import pytest
import yaml

from tests.dist_utils import free_port, launcher_env  # noqa: F401  (free_port: re-exported for the launch tests)
from tests.rl.conftest import EASY

REPO = Path(__file__).resolve().parents[2]


def write_experiment(path: Path, **sections) -> Path:
    """A tiny experiment YAML (the RL tests' easy task, 3 GRPO steps) with ``sections`` merged in."""
    data = {k: dict(v) for k, v in EASY.items()}
    data["grpo"]["steps"] = 3
    data["eval"]["every"] = 3
    data["threads"] = 1
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def launch_env(warmup_cache):
    """Environment for launcher subprocesses: this venv's tools first, one thread per rank."""
    return launcher_env()


@pytest.fixture(scope="session")
def warmup_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("launch-warmup-cache"))
