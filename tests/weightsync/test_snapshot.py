"""Versioned snapshots: complete sharded checkpoints, switched atomically, old ones pruned; with
deltas, a dense base plus a chain of signed grid-step deltas from which a restarted engine
rebuilds the newest version that verifies, bit for bit."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dist_sr.engines.checkpoints import verify_manifest, write_manifest
from dist_sr.launch.cli import main
from dist_sr.sources import ReplicatedSource, layout_free_digest
from dist_sr.testing.vllm_engines import REPO, save_tiny_model
from dist_sr.weightsync.disk.materialize import OutputRefused, materialize
from dist_sr.weightsync.disk.snapshot import CHAIN, SnapshotError, Snapshots, versions, write_snapshot


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
def _srversions(model, versions, seed=7):
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
    for v, bits in _srversions(model, versions):
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
    assert versions(root, "v") == [0] and versions(root / CHAIN, "v") == list(range(1, 6))
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
    assert versions(root, "v") == [3, 6] and versions(root / CHAIN, "v") == [4, 5, 7, 8]  # pruned with v0
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
    assert versions(tmp_path / "s", "v") == [1, 2] and versions(tmp_path / "s" / CHAIN, "v") == []


def test_a_new_base_is_written_once_the_chain_outgrows_half_a_base(tiny, tmp_path):
    model, tok = tiny
    snaps = Snapshots(tmp_path / "s", bucket_mb=0.1, deltas=True, keep=3)
    bases = []
    for v, _ in _srversions(model, range(16)):
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
    for v, bits in _srversions(model, range(4)):
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


# ---- materialize's OUT, the signed versions, the kernels -------------------------------------------
@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Versions 0..3 of the tiny model as a base and three deltas, written once: (root, each
    version's bits). Tests that change it copy it first (``_copy``)."""
    tmp = tmp_path_factory.mktemp("chain")
    model_dir = save_tiny_model(tmp / "m")
    tiny = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16),
        AutoTokenizer.from_pretrained(model_dir),
    )
    root = tmp / "snapshots"
    return root, _write(tiny, root, range(4))


def _copy(chain, where):
    shutil.copytree(chain[0], where, symlinks=True)
    return where


def _tree(path) -> dict:
    """Every entry under ``path`` with its bytes (None for a directory)."""
    return {str(p.relative_to(path)): None if p.is_dir() else p.read_bytes() for p in sorted(path.rglob("*"))}


def _cli(*argv, env=None, cwd=REPO):
    """``dist-sr ARGV`` in a process of its own: (exit status, stdout, stderr)."""
    r = subprocess.run(
        [sys.executable, "-m", "dist_sr.launch.cli", *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r.returncode, r.stdout, r.stderr


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("where", ["DIR", "DIR/chain", "DIR/v0", "DIR/new", "DIR/chain/../new", "above DIR", "link"])
def test_an_out_that_is_the_snapshots_inside_them_or_holding_them_is_refused_before_anything_is_touched(
    chain, tmp_path, where, capsys
):
    work = tmp_path / "run"
    root = _copy(chain, work / "snapshots")
    (work / "metrics.jsonl").write_text('{"step": 1}\n')  # a run directory's history
    (tmp_path / "link").symlink_to(root)
    out = {
        "DIR": root,
        "DIR/chain": root / CHAIN,
        "DIR/v0": root / "v0",
        "DIR/new": root / "new",
        "DIR/chain/../new": f"{root}/{CHAIN}/../new",
        "above DIR": work,
        "link": tmp_path / "link",
    }[where]
    before = _tree(tmp_path)
    with pytest.raises(OutputRefused, match=r"OUT .* (is the snapshot directory|holds the snapshot directory)"):
        materialize(root, out)
    assert main(["snapshot", "materialize", str(root), str(out)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("dist-sr: materialize refused: OUT") and str(root) in line
    assert _tree(tmp_path) == before  # nothing written, moved or deleted


def test_an_out_holding_what_materialize_did_not_write_is_refused_and_left_as_it_was(chain, tmp_path):
    root, states = chain
    user_file = tmp_path / "weights"
    user_file.write_text("my notes")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    for out, match in ((user_file, "is a file that materialize did not write"), (run_dir, r"metrics\.jsonl")):
        before = _tree(tmp_path)
        for _ in range(2):  # the same refusal again: nothing was hidden aside the first time
            with pytest.raises(OutputRefused, match=match):
                materialize(root, out)
            assert _tree(tmp_path) == before
    # a checkpoint materialize wrote is replaced; with a file added to it, it is not
    engine = tmp_path / "engine"
    engine.mkdir()  # an empty directory is a place to write
    assert materialize(root, engine).version == 3 and materialize(root, engine).version == 3
    (engine / "notes.txt").write_text("mine")
    with pytest.raises(OutputRefused, match=r"notes\.txt"):
        materialize(root, engine)
    assert (engine / "notes.txt").read_text() == "mine" and _bits_equal(_loaded(engine), states[3])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine", "run", "weights"]  # nothing left beside


@pytest.mark.parametrize("out", [".", "", "a-file/engine"])
def test_an_unusable_out_is_one_line_naming_it_and_the_fix(chain, tmp_path, monkeypatch, capsys, out):
    root, _ = chain
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    assert main(["snapshot", "materialize", str(root), out]) == 2
    line = _one_line(capsys.readouterr().err)
    if out in (".", ""):
        assert f"OUT {out!r} names no directory of its own" in line and "give a new path" in line
    else:
        assert f"cannot write {tmp_path / 'a-file'}" in line and "a file is in the way" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_read_only_parent_is_one_line_and_the_checkpoint_there_is_kept(chain, tmp_path):
    root, states = chain
    parent = tmp_path / "ro"
    parent.mkdir()
    materialize(root, parent / "engine")
    before = _tree(parent)
    argv = [sys.executable, "-m", "dist_sr.launch.cli", "snapshot", "materialize", str(root), str(parent / "engine")]
    if os.geteuid() == 0:  # root writes through permissions: a read-only bind mount in a mount namespace
        script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
        cmd = ["unshare", "--mount", "sh", "-c", script, "sh", str(parent), *argv]
    else:
        parent.chmod(0o555)
        cmd = argv
    try:
        r = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    finally:
        parent.chmod(0o755)
    assert r.returncode == 2, r.stderr
    line = _one_line(r.stderr)
    assert f"cannot write {parent} (OUT {parent / 'engine'})" in line
    assert "read-only" in line or "writable" in line
    assert _tree(parent) == before and _bits_equal(_loaded(parent / "engine"), states[3])


def _waiting_on(directory) -> int:
    """Processes blocked in ``flock`` on ``directory`` (``/proc/locks``: ``N: -> FLOCK ... dev:inode``)."""
    ino = os.stat(directory).st_ino
    lines = open("/proc/locks").read().splitlines()
    return sum(1 for line in lines if "-> FLOCK" in line and line.split()[6].split(":")[-1] == str(ino))


def test_runs_into_one_out_take_turns_and_each_ends_in_a_verified_checkpoint(chain, tmp_path):
    import fcntl

    root, states = chain
    out = tmp_path / "engines" / "model"
    out.parent.mkdir()
    held = os.open(out.parent, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # a run in progress
    argv = [sys.executable, "-m", "dist_sr.launch.cli", "snapshot", "materialize", str(root), str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in "abc"]
    try:
        deadline = time.monotonic() + 240
        while _waiting_on(out.parent) < 3:  # each of the three waits its turn, having written nothing
            assert not any(p.poll() is not None for p in procs), "a run went on while another held OUT"
            assert os.listdir(out.parent) == [], "a run wrote beside OUT while another held it"
            assert time.monotonic() < deadline
            time.sleep(0.05)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    finally:
        os.close(held)
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], results
    verify_manifest(out)
    assert _bits_equal(_loaded(out), states[3]) and os.listdir(out.parent) == ["model"]


def test_a_run_killed_before_its_move_leaves_out_as_it_was_and_the_next_run_cleans_up(chain, tmp_path):
    root, states = chain
    older = _copy(chain, tmp_path / "older")
    shutil.rmtree(older / CHAIN / "v3")
    out = tmp_path / "engines" / "model"
    assert materialize(older, out).version == 2
    code, _, _ = _cli("snapshot", "materialize", str(root), str(out), env={"DIST_SR_FAULT": "materialize.staged:1"})
    assert code == -signal.SIGKILL
    verify_manifest(out)
    assert _bits_equal(_loaded(out), states[2])  # the killed run changed nothing there
    assert [p.name.endswith(".partial") for p in out.parent.iterdir() if p.name != "model"] == [True]
    assert materialize(root, out).version == 3
    assert os.listdir(out.parent) == ["model"] and _bits_equal(_loaded(out), states[3])


def test_a_renamed_or_copied_entry_is_refused_naming_its_signed_version_and_its_name(chain, tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_SR_SYNC_SECRET", "s" * 32)
    _, states = chain
    root = _copy(chain, tmp_path / "snapshots")
    for entry in [root / "v0", *(root / CHAIN).iterdir()]:  # signed by this job: only names change below
        write_manifest(entry)
    shutil.copytree(root / "v0", root / "v9")  # base v0 copied in as a newer "v9"
    got = materialize(root, tmp_path / "a")
    assert (got.version, got.base) == (3, 0) and len(got.refused) == 1
    assert "base v9" in got.refused[0] and "say version 0, its name says 9" in got.refused[0]
    assert _bits_equal(_loaded(got.path), states[3])
    shutil.rmtree(root / "v9")
    (root / CHAIN / "v3").rename(root / CHAIN / "v4")  # version 3 served as 4
    got = materialize(root, tmp_path / "b")
    assert got.version == 2 and "delta v4" in got.refused[0] and "say version 3, its name says 4" in got.refused[0]
    assert _bits_equal(_loaded(got.path), states[2])


_MATERIALIZE = (
    "import sys\n"
    "from dist_sr.numerics.backends import cpu\n"
    "from dist_sr.weightsync.disk.materialize import materialize\n"
    "m = materialize(sys.argv[1], sys.argv[2])\n"
    "print(m.version, m.digest, cpu.loaded() is not None, cpu.loaded_delta() is not None)\n"
)


def test_materialize_takes_the_kernels_and_writes_the_bytes_the_torch_paths_write(chain, tmp_path):
    root, states = chain
    runs = {}
    for name, env in (("kernel", {}), ("torch", {"DIST_SR_DISABLE_CPU_KERNEL": "1"})):
        r = subprocess.run(
            [sys.executable, "-c", _MATERIALIZE, str(root), str(tmp_path / name)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **env},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = r.stdout.split()
    digest = runs["kernel"][1]
    assert runs == {"kernel": ["3", digest, "True", "True"], "torch": ["3", digest, "False", "False"]}
    assert _tree(tmp_path / "kernel") == _tree(tmp_path / "torch")  # bit for bit, file by file
    assert _bits_equal(_loaded(tmp_path / "kernel"), states[3])
