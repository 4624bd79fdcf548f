"""Changed elements as (index, value) pairs for the peers' delta syncs (vLLM ``sparse_nccl``,
verl ``delta_sharded``): applied by index the way their loaders do, they give the new version
bit for bit, from any shard layout; a NaN value (their 'unchanged' marker) is refused by name."""

import subprocess
import sys

import pytest
import torch

from dist_sr.numerics.rounding import stochastic_round
from dist_sr.sources import ReplicatedSource
from dist_sr.weightsync.sparse import SparseExport, SparseUnsupported, sparse_patch, to_vllm
from tests.vllm_engines import REPO, VLLM_PYTHON, vllm_missing

# 16-bit codes at the awkward places (+-0, subnormals, the largest finite, +-Inf, NaN payloads,
# exponent boundaries), and what each becomes: -0 <-> +0, subnormal steps, Inf <-> largest finite,
# a NaN that becomes finite (a change), a NaN that stays (none), steps across exponent boundaries
OLD_CODES = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF]
OLD_CODES += [0x3F7F, 0x3F80, 0xBF7F, 0xBF80]
NEW_CODES = [0x8000, 0x0000, 0x0002, 0x8000, 0x0080, 0x007F, 0x7F80, 0xFF7F, 0x7F7F, 0xFF80, 0x3F80, 0xFFFF]
NEW_CODES += [0x3F80, 0x3F7F, 0xBF80, 0xBF7F]


def _codes(codes) -> torch.Tensor:
    return torch.tensor(codes, dtype=torch.int32).to(torch.int16)


def _apply_like_the_peers(old: torch.Tensor, patches) -> torch.Tensor:
    out = old.clone().reshape(-1)
    for p in patches:
        out.view(torch.int16)[p.indices.long()] = p.values.view(torch.int16)
    return out.view(old.shape)


def test_pairs_reproduce_sr_steps_and_special_values_bit_for_bit_from_two_shard_layouts():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.Linear(50, 3)).to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight.view(-1)[:16].view(torch.int16).copy_(_codes(OLD_CODES))
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    exports = [SparseExport(ReplicatedSource(model, rank, 2)) for rank in (0, 1)]  # each rank's half
    assert all(e.patches() is None for e in exports)  # the first sync is dense
    with torch.no_grad():
        for n, p in model.named_parameters():
            shadow = p.float() + 1e-4 * torch.randn(p.shape, generator=g)
            p.copy_(stochastic_round(shadow, seed=3, step=1, param=n))
        model[0].weight.view(-1)[:16].view(torch.int16).copy_(_codes(NEW_CODES))
    patches = [p for e in exports for p in e.patches()]
    assert {p.name for p in patches} == set(old)
    for p in patches:
        assert p.indices.dtype == torch.int32 and bool((p.indices[1:] > p.indices[:-1]).all())
        assert p.nbytes == 6 * p.indices.numel()
    for n, t in model.named_parameters():
        mine = [p for p in patches if p.name == n]
        assert torch.equal(_apply_like_the_peers(old[n], mine).view(torch.int16), t.detach().view(torch.int16)), n
    changed = sum(p.indices.numel() for p in patches) / sum(t.numel() for t in old.values())
    assert 0.05 < changed < 0.6  # an Adam-sized step under SR moves a sizeable share
    assert all(p.indices.numel() == 0 for e in exports for p in e.patches())  # nothing moved since
    exports[0].reset()  # the peer missed a sync: the next one is dense
    assert exports[0].patches() is None and exports[1].patches() is not None


def test_a_weight_that_becomes_nan_is_refused_by_name_and_dense_pieces_say_so():
    old = torch.ones(10, dtype=torch.bfloat16)
    new = old.clone()
    new[3] = float("nan")
    with pytest.raises(SparseUnsupported, match="w.*NaN.*dense"):
        sparse_patch("w", old, new, (10,))
    moved = old.clone().view(torch.int16).add_(1).view(torch.bfloat16)  # every element one grid step
    assert not sparse_patch("w", old, moved, (10,)).worth_it()  # 6 bytes per change > 2 dense
    assert sparse_patch("w", old, old, (10,)).worth_it()


def test_to_vllm_names_what_is_missing_without_a_sparse_engine():
    if "vllm" in sys.modules or _importable("vllm"):
        pytest.skip("vLLM is installed in this environment: the next test covers the conversion")
    with pytest.raises(SparseUnsupported, match="sparse_nccl"):
        to_vllm([])


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")
def test_to_vllm_gives_vllms_own_sparse_patches():
    code = (
        "import torch\n"
        "from dist_sr.weightsync.sparse import sparse_patch, to_vllm\n"
        "from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch\n"
        "a = torch.ones(6, dtype=torch.bfloat16); b = a.clone(); b[2] = 2\n"
        "(v,) = to_vllm([sparse_patch('w', a, b, (2, 3))])\n"
        "assert isinstance(v, SparseWeightPatch) and v.indices.tolist() == [2] and v.full_shape == (2, 3)\n"
        "assert v.indices.dtype == torch.int32 and v.values.tolist() == [2.0]\n"
        "print('ok')\n"
    )
    r = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
