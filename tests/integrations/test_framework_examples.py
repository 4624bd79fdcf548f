"""The recipes in docs/integrations.md run as written: each framework's pattern (OpenRLHF's
DeepSpeed strategy, verl's FSDP2 workers, NeMo-RL's DTensor worker) on 2 gloo ranks, and what it
exports for vLLM equals the trainer's working weights bitwise, where the plain dtype cast does not."""

import json
import subprocess

import pytest

from tests.dist_utils import REPO, free_port, launcher_env

pytestmark = pytest.mark.slow
EXAMPLES = REPO / "examples" / "frameworks"


def run(tmp_path, script: str, *args: str) -> dict:
    out = tmp_path / "result.json"
    r = subprocess.run(["torchrun", "--nproc-per-node", "2", f"--master-port={free_port()}", str(EXAMPLES / script),
                        *args], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**launcher_env(), "EXAMPLE_RESULT": str(out)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("stage", [2, 3])
def test_openrlhf_pattern_broadcasts_the_keyed_bits(tmp_path, stage):
    pytest.importorskip("deepspeed")
    result = run(tmp_path, "openrlhf_deepspeed.py", "--zero-stage", str(stage))
    assert result["bitwise_equal"] and result["key_step"] == 3 and result["tensors"] == 27


@pytest.mark.parametrize("script", ["verl_fsdp2.py", "nemo_rl_dtensor.py"])
def test_fsdp2_patterns_export_the_forward_weights(tmp_path, script):
    result = run(tmp_path, script)
    assert result["bitwise_equal"] and result["key_step"] == 3 and result["tensors"] == 27
    assert result["rtn_cast_mismatch"] > 0.05  # the cast they replace would not hold the trainer's bits
