"""Changed elements as (index, value) pairs for the peers' delta syncs (vLLM ``sparse_nccl``,
verl ``delta_sharded``): applied by index the way their loaders do, they give the new version
bit for bit, from any shard layout; a NaN value (their 'unchanged' marker) is refused by name."""

import subprocess
import sys

import pytest
import torch

from dist_sr.numerics.digest import combine, tensor_sums
from dist_sr.numerics.rounding import stochastic_round
from dist_sr.sources import ReplicatedSource
from dist_sr.testing.vllm_engines import REPO, VLLM_PYTHON, vllm_missing
from dist_sr.weightsync.trainer.sparse import SparseExport, SparseUnsupported, differing, sparse_patch, to_vllm

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
    assert all(e.export().patches is None for e in exports)  # the first sync is dense
    for e in exports:
        e.delivered()
    with torch.no_grad():
        for n, p in model.named_parameters():
            shadow = p.float() + 1e-4 * torch.randn(p.shape, generator=g)
            p.copy_(stochastic_round(shadow, seed=3, step=1, param=n))
        model[0].weight.view(-1)[:16].view(torch.int16).copy_(_codes(NEW_CODES))
    patches = [p for e in exports for p in e.export().patches]
    for e in exports:
        e.delivered()
    assert {p.name for p in patches} == set(old)
    for p in patches:
        assert p.indices.dtype == torch.int32 and bool((p.indices[1:] > p.indices[:-1]).all())
        assert p.nbytes == 6 * p.indices.numel()
    for n, t in model.named_parameters():
        mine = [p for p in patches if p.name == n]
        assert torch.equal(_apply_like_the_peers(old[n], mine).view(torch.int16), t.detach().view(torch.int16)), n
    changed = sum(p.indices.numel() for p in patches) / sum(t.numel() for t in old.values())
    assert 0.05 < changed < 0.6  # an Adam-sized step under SR moves a sizeable share
    assert all(p.indices.numel() == 0 for e in exports for p in e.export().patches)  # nothing moved since
    exports[0].reset()  # the peer missed a sync: the next one is dense
    assert exports[0].export().patches is None and exports[1].export().patches is not None


def _three_tensors():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 9)).to(torch.bfloat16)


def _sr_step(model, step, g):
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(stochastic_round(p.float() + 3e-4 * torch.randn(p.shape, generator=g), seed=5, step=step, param=n))


def _peer_sync(peer: dict, model, export: SparseExport) -> str:
    """One sync of a peer that takes pairs and is told to go dense on a refusal, as a caller that
    never calls ``reset()`` would drive it; returns how it went."""
    try:
        sync = export.export()
    except SparseUnsupported:  # "sync this version dense": the caller does, outside the exporter
        peer.update({n: p.detach().clone() for n, p in model.named_parameters()})
        return "dense after a refusal"
    if sync.patches is None:
        peer.update({n: p.detach().clone() for n, p in model.named_parameters()})
    else:
        for n in peer:
            peer[n] = _apply_like_the_peers(peer[n], [p for p in sync.patches if p.name == n])
    export.delivered()
    assert differing(sync.entries, peer) == [] and sync.digest == combine(tensor_sums(peer))
    return "dense" if sync.patches is None else "pairs"


def test_a_refused_export_changes_no_held_copy_and_the_peer_stays_right_without_a_reset():
    """A NaN in the last tensor refuses the export after the others were compared: the held
    copies must still be the peer's version, whatever the caller does next."""
    g = torch.Generator().manual_seed(2)
    model = _three_tensors()
    export, peer = SparseExport(ReplicatedSource(model)), {}
    ways = []
    for step in range(6):
        _sr_step(model, step, g)
        last = list(model.parameters())[-1]
        saved = last.detach().clone()
        if step == 2:
            with torch.no_grad():
                last.view(-1)[3] = float("nan")
        ways.append(_peer_sync(peer, model, export))
        for n, p in model.named_parameters():
            assert torch.equal(peer[n].view(torch.int16), p.detach().view(torch.int16)), (step, n)
        if step == 2:
            with torch.no_grad():
                last.copy_(saved)  # the run recovers (a rollback, a skipped step)
    assert ways == ["dense", "pairs", "dense after a refusal", "dense", "pairs", "pairs"]


def test_pairs_not_delivered_leave_the_next_pairs_against_what_the_peer_holds():
    g = torch.Generator().manual_seed(3)
    model = _three_tensors()
    export, peer = SparseExport(ReplicatedSource(model)), {}
    _peer_sync(peer, model, export)
    _sr_step(model, 1, g)
    lost = export.export()  # sent, never arrived: not delivered
    assert lost.patches and sum(p.indices.numel() for p in lost.patches) > 0
    _sr_step(model, 2, g)
    assert _peer_sync(peer, model, export) == "pairs"  # against version 0, which the peer holds
    for n, p in model.named_parameters():
        assert torch.equal(peer[n].view(torch.int16), p.detach().view(torch.int16)), n
    with pytest.raises(RuntimeError, match="nothing exported since the last delivery"):
        export.delivered()


def test_the_digest_beside_the_pairs_names_the_tensor_a_peer_holds_otherwise():
    g = torch.Generator().manual_seed(4)
    model = _three_tensors()
    export, peer = SparseExport(ReplicatedSource(model)), {}
    _peer_sync(peer, model, export)
    _sr_step(model, 1, g)
    sync = export.export()
    dropped = [p for p in sync.patches if p.name != "1.weight"]  # one tensor's pairs lost on the way
    for n in peer:
        peer[n] = _apply_like_the_peers(peer[n], [p for p in dropped if p.name == n])
    assert differing(sync.entries, peer) == ["1.weight"] and sync.digest != combine(tensor_sums(peer))
    assert sync.digest == combine(tensor_sums(dict(model.named_parameters())))


def _two_rank_export(rank, world, out):
    model = _three_tensors()
    export = SparseExport(ReplicatedSource(model, rank, world))
    first = export.export()
    export.delivered()
    _sr_step(model, 1, torch.Generator().manual_seed(5))
    with torch.no_grad():
        model[1].bias.view(-1)[-1] = float("nan")  # in rank 1's half only
    try:
        export.export()
        refused = ""
    except SparseUnsupported as exc:
        refused = str(exc)
    again = export.export()  # dense on both ranks after the refusal
    if rank == 0:
        torch.save({"first": first.digest, "refused": refused, "again": again.patches is None}, out)
    else:
        assert refused and again.patches is None


@pytest.mark.slow
def test_every_rank_refuses_together_and_the_digest_adds_up_the_ranks_pieces(tmp_path):
    from tests.dist_utils import run_workers

    out = tmp_path / "r.pt"
    run_workers(_two_rank_export, 2, str(out))
    got = torch.load(out)
    assert got["first"] == combine(tensor_sums(dict(_three_tensors().named_parameters())))
    assert "1.bias" in got["refused"] and "NaN" in got["refused"] and got["again"]


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
        "from dist_sr.weightsync.trainer.sparse import sparse_patch, to_vllm\n"
        "from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch\n"
        "a = torch.ones(6, dtype=torch.bfloat16); b = a.clone(); b[2] = 2\n"
        "(v,) = to_vllm([sparse_patch('w', a, b, (2, 3))])\n"
        "assert isinstance(v, SparseWeightPatch) and v.indices.tolist() == [2] and v.full_shape == (2, 3)\n"
        "assert v.indices.dtype == torch.int32 and v.values.tolist() == [2.0]\n"
        "print('ok')\n"
    )
    r = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_patches_is_an_export_delivered_at_once_and_a_refusal_still_changes_no_held_copy():
    g = torch.Generator().manual_seed(6)
    model = _three_tensors()
    export, peer, ways = SparseExport(ReplicatedSource(model)), {}, []

    def sync():
        patches = export.patches()
        for n, p in model.named_parameters():
            mine = [q for q in patches or [] if q.name == n]
            peer[n] = p.detach().clone() if patches is None else _apply_like_the_peers(peer[n], mine)
            assert torch.equal(peer[n].view(torch.int16), p.detach().view(torch.int16)), n
        ways.append("dense" if patches is None else "pairs")

    sync()
    _sr_step(model, 1, g)
    sync()
    _sr_step(model, 2, g)
    last = list(model.parameters())[-1]
    saved = last.detach().clone()
    with torch.no_grad():
        last.view(-1)[0] = float("nan")
    with pytest.raises(SparseUnsupported, match="NaN"):
        export.patches()
    peer.update({n: p.detach().clone() for n, p in model.named_parameters()})  # the dense sync asked for
    with torch.no_grad():
        last.copy_(saved)
    for step in (3, 4):
        _sr_step(model, step, g)
        sync()
    assert ways == ["dense", "pairs", "dense", "pairs"]
