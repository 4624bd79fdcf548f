import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.dist_utils import free_port  # noqa: F401  (re-exported for the launch tests)
from tests.rl.conftest import EASY

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # torchrun / deepspeed / dist-sr of this environment


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
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(PATH=f"{BIN}:{env.get('PATH', '')}", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=str(REPO))
    return env


@pytest.fixture(scope="session")
def warmup_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("launch-warmup-cache"))
