"""The NeMo-RL recipe in docs/integrations.md runs as written: its DTensor worker's pattern on 2
gloo ranks, and what it exports for vLLM equals the trainer's working weights bitwise, where the
plain dtype cast does not. (NeMo-RL cannot be installed from the index; verl and OpenRLHF are
tested on their own packages, tests/peers/ and scripts/peer_stacks.sh.)"""

import json
import subprocess

import pytest

from tests.dist_utils import REPO, free_port, launcher_env

pytestmark = pytest.mark.slow
EXAMPLES = REPO / "examples" / "frameworks"


def run(tmp_path, script: str, *args: str) -> dict:
    out = tmp_path / "result.json"
    r = subprocess.run(
        ["torchrun", "--nproc-per-node", "2", f"--master-port={free_port()}", str(EXAMPLES / script), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**launcher_env(), "EXAMPLE_RESULT": str(out)},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(out.read_text())


def test_nemo_rl_pattern_exports_the_forward_weights(tmp_path):
    result = run(tmp_path, "nemo_rl_dtensor.py")
    assert result["bitwise_equal"] and result["key_step"] == 3 and result["tensors"] == 27
    assert result["rtn_cast_mismatch"] > 0.05  # the cast they replace would not hold the trainer's bits
