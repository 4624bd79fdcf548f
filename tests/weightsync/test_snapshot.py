"""Versioned snapshots: complete sharded checkpoints, switched atomically, old ones pruned; with
deltas, a dense base plus a chain of signed grid-step deltas from which a restarted engine
rebuilds the newest version that verifies, bit for bit."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dist_sr.engines.checkpoints import verify_manifest, write_manifest
from dist_sr.sources import ReplicatedSource, layout_free_digest
from dist_sr.weightsync.snapshot import CHAIN, SnapshotError, Snapshots, _versions, materialize, write_snapshot
from tests.vllm_engines import save_tiny_model


def test_a_snapshot_reloads_bit_for_bit_and_current_moves_atomically(tmp_path):
    model_dir = save_tiny_model(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(model_dir)
    root = tmp_path / "snapshots"
    for version in (0, 1, 2):
        with torch.no_grad():
            model.lm_head.weight.add_(0.125)
        path = write_snapshot(ReplicatedSource(model), root, version, config=model.config, tokenizer=tok, bucket_mb=0.1)
        assert (root / "current").resolve() == path.resolve() == (root / f"v{version}").resolve()
    assert sorted(p.name for p in root.iterdir()) == ["current", "v1", "v2"]  # keep=2, no partial left
    assert len(list((root / "v2").glob("model-*.safetensors"))) > 1  # bucket by bucket
    again = AutoModelForCausalLM.from_pretrained(root / "current")
    assert again.dtype == torch.bfloat16
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), n
    assert AutoTokenizer.from_pretrained(root / "current").get_vocab() == tok.get_vocab()


# ---- a dense base plus deltas --------------------------------------------------------------------
def _sr_versions(model, versions, seed=7):
    """Keyed-SR steps of Adam size on ``model`` (BF16): yields (version, the bits of every tensor)."""
    from dist_sr.numerics.rounding import stochastic_round

    gen = torch.Generator().manual_seed(seed)
    shadows = {n: p.detach().float() + 1e-3 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    for v in versions:
        with torch.no_grad():
            for n, p in model.named_parameters():
                shadows[n] += 2e-5 * torch.randn(p.shape, generator=gen)
                p.copy_(stochastic_round(shadows[n], seed=seed, step=v, param=n))
        yield v, {n: p.detach().clone() for n, p in model.named_parameters()}


def _bits_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def _loaded(path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _write(tiny, root, versions, **options) -> dict:
    """Keyed-SR versions of the tiny model written as snapshots (deltas on); each version's bits."""
    model, tok = tiny
    snaps = Snapshots(root, model.config, tok, bucket_mb=0.1, deltas=True, **options)
    states = {}
    for v, bits in _sr_versions(model, versions):
        snaps.write(ReplicatedSource(model), v)
        states[v] = bits
    return states


@pytest.fixture
def tiny(tmp_path):
    model_dir = save_tiny_model(tmp_path / "m")
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16), AutoTokenizer.from_pretrained(
        model_dir
    )


def test_a_restarted_engine_catches_up_from_a_base_and_deltas_on_disk_bit_for_bit(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_SR_SYNC_SECRET", "s" * 32)
    root = tmp_path / "snapshots"
    states = _write(tiny, root, range(6))
    assert _versions(root, "v") == [0] and _versions(root / CHAIN, "v") == list(range(1, 6))
    base = sum(f.stat().st_size for f in (root / "v0").glob("*.safetensors"))
    for v in range(1, 6):  # SR moves ~1/4 of the weights one grid step: a delta is ~1/13 of the weights
        assert (root / CHAIN / f"v{v}" / "rank00000.bin").stat().st_size < base / 8
    got = materialize(root, tmp_path / "engine")
    assert (got.version, got.base, got.deltas, got.refused) == (5, 0, 5, ())
    assert got.digest == layout_free_digest(ReplicatedSource(tiny[0]), 1)  # what a sync of version 5 verifies
    assert _bits_equal(_loaded(got.path), states[5])
    served = AutoModelForCausalLM.from_pretrained(got.path)  # what an engine starts from
    assert served.dtype == torch.bfloat16
    assert _bits_equal({n: p for n, p in served.named_parameters() if n in states[5]}, states[5])
    verify_manifest(got.path)  # the engine's copy carries its own signed manifest


def test_a_damaged_delta_stops_the_catch_up_at_the_last_version_that_verifies(tiny, tmp_path):
    root = tmp_path / "snapshots"
    states = _write(tiny, root, range(6))
    blob = root / CHAIN / "v4" / "rank00000.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x10
    blob.write_bytes(bytes(data))
    got = materialize(root, tmp_path / "engine")
    assert got.version == 3 and len(got.refused) == 1 and "delta v4" in got.refused[0]
    assert _bits_equal(_loaded(got.path), states[3])  # never a half-applied version
    # the same damage behind a rewritten manifest is caught by the digest of the result
    write_manifest(blob.parent)
    got = materialize(root, tmp_path / "engine")
    assert got.version == 3 and "digest" in got.refused[0], got.refused
    assert _bits_equal(_loaded(got.path), states[3])


def test_a_damaged_base_falls_back_to_the_previous_base_and_its_chain(tiny, tmp_path):
    root = tmp_path / "snapshots"
    states = _write(tiny, root, range(9), base_every=3)
    assert _versions(root, "v") == [3, 6] and _versions(root / CHAIN, "v") == [4, 5, 7, 8]  # pruned with v0
    assert materialize(root, tmp_path / "a").version == 8
    shard = sorted((root / "v6").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    got = materialize(root, tmp_path / "b")
    assert (got.version, got.base) == (5, 3) and "base v6" in got.refused[0]
    assert _bits_equal(_loaded(got.path), states[5])


def test_snapshots_signed_by_the_job_are_refused_without_its_secret_and_forgeries_are_refused(
    tiny, tmp_path, monkeypatch
):
    monkeypatch.setenv("DIST_SR_SYNC_SECRET", "s" * 32)
    root = tmp_path / "snapshots"
    _write(tiny, root, range(3))
    monkeypatch.setenv("DIST_SR_SYNC_SECRET", "t" * 32)  # another job's secret: nothing verifies
    with pytest.raises(SnapshotError, match="signature does not match"):
        materialize(root, tmp_path / "engine")
    monkeypatch.setenv("DIST_SR_SYNC_SECRET", "s" * 32)
    write_manifest(root / CHAIN / "v2", key=b"x" * 32)  # a forged chain entry
    got = materialize(root, tmp_path / "engine")
    assert got.version == 1 and "signature" in got.refused[0]


def test_fp32_working_weights_get_dense_snapshots_only(tmp_path):
    model = torch.nn.Linear(8, 4)
    snaps = Snapshots(tmp_path / "s", deltas=True)
    for v in range(3):
        snaps.write(ReplicatedSource(model), v)
    assert _versions(tmp_path / "s", "v") == [1, 2] and _versions(tmp_path / "s" / CHAIN, "v") == []


def test_a_new_base_is_written_once_the_chain_outgrows_half_a_base(tiny, tmp_path):
    model, tok = tiny
    snaps = Snapshots(tmp_path / "s", bucket_mb=0.1, deltas=True, keep=3)
    bases = []
    for v, _ in _sr_versions(model, range(16)):
        snaps.write(ReplicatedSource(model), v)
        bases.append(snaps.base_version)
        assert snaps.chain_bytes <= snaps.base_bytes // 2 + snaps.base_bytes // 8  # at most one delta past half
    assert bases[0] == 0 and 0 < len(set(bases)) < 16 // 2  # bases every ~7 versions, deltas between


def _two_rank_worker(rank, world, root):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7)).to(torch.bfloat16)
    source = ReplicatedSource(model, rank, world)  # each rank holds one half of every tensor
    snaps = Snapshots(root, bucket_mb=0.01, deltas=True)
    states = {}
    for v, bits in _sr_versions(model, range(4)):
        snaps.write(source, v)
        states[v] = bits
    if rank == 0:
        torch.save(states[3], f"{root}/expected.pt")


@pytest.mark.slow
def test_every_rank_writes_the_deltas_of_its_own_pieces_and_the_engine_rebuilds_the_whole(tmp_path):
    from tests.dist_utils import run_workers

    root = tmp_path / "snapshots"
    run_workers(_two_rank_worker, 2, str(root))
    sizes = [(root / CHAIN / "v3" / f"rank{r:05d}.bin").stat().st_size for r in (0, 1)]
    assert all(s > 0 for s in sizes)  # both halves, written where they live
    got = materialize(root, tmp_path / "engine")
    assert (got.version, got.deltas, got.refused) == (3, 3, ())
    expected = torch.load(root / "expected.pt")
    assert _bits_equal(_loaded(got.path), expected)
