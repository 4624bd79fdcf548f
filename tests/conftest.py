import json
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytest_plugins = ["tests.ci_skips"]  # under CI=true a skip (other than "no CUDA device") fails

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors; this must be set
# before any kernel is defined (at import of dist_sr.numerics.backends.triton.kernels).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The sync secret this test session's trainers, receivers and vLLM engines share (inherited by
# every process a test starts); tests of its absence or of a wrong one pass their own.
os.environ.setdefault("DIST_SR_SYNC_SECRET", "dist-sr-test-secret-" + os.urandom(16).hex())

# Every backend that must give the contract's bits on this machine.
CPU_BACKENDS = ["reference", "cpu"]


@pytest.fixture(params=CPU_BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="session")
def vectors():
    return json.loads((ROOT / "docs" / "rounding-key-vectors.json").read_text())


def bits16(t: torch.Tensor) -> torch.Tensor:
    """BF16 tensor -> its raw bits as int32 in [0, 65536)."""
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


def f32_from_bits(bits) -> torch.Tensor:
    """uint32 bit patterns (ints or int64 tensor) -> float32 tensor."""
    b = torch.as_tensor(bits, dtype=torch.int64)
    b = b - ((b >> 31) & 1) * (1 << 32)
    return b.to(torch.int32).view(torch.float32)
