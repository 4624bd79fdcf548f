"""A damaged checkpoint never costs the run: bits flipped and bytes inverted at random positions
(fixed seeds) of every file of the newest checkpoint of each kind (one process, FSDP2/DCP,
DeepSpeed), then a resume. Each time it resumes from a checkpoint that verifies, with that
checkpoint's exact state: the newest if the damage left its content intact, else the previous
one; a refused checkpoint is moved to ``refused/`` (never rotated over the good one, never named
by ``latest``), and the run saves past the refused step. Counts are in docs/testing.md."""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
import zipfile

import pytest
import torch

from dist_sr.engines.base import TrainSettings
from dist_sr.engines.checkpoints import REFUSED
from dist_sr.engines.config import DistributedConfig
from dist_sr.engines.single import SingleEngine
from dist_sr.precision import PrecisionConfig
from tests.dist_utils import run_workers
from tests.engines.models import tiny_qwen2

SEED = 3
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on the CPU (read when it is imported)


def damages(size: int, rng: random.Random, flips: int, inversions: int, inside: tuple[int, int] | None = None):
    """``(offset, xor mask)``: single-bit flips and whole-byte inversions at random offsets (some
    inside ``inside``, a region that matters most, when given)."""
    out = []
    for i in range(flips + inversions):
        lo, hi = inside if inside is not None and i % 2 else (0, size)
        out.append((rng.randrange(lo, hi), 1 << rng.randrange(8) if i < flips else 0xFF))
    return out


def damaged_copy(src, dst, relative: str, offset: int, mask: int) -> None:
    shutil.copytree(src, dst)
    path = dst / relative
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


# -- one process ---------------------------------------------------------------------------------


def single(precision="bf16-sr"):
    return SingleEngine(
        TrainSettings(precision=PrecisionConfig(precision, seed=SEED), distributed=DistributedConfig(), lr=1e-2),
        tiny_qwen2(),
    )


def step(eng, n=1):
    ids = torch.randint(0, 3, (2, 9), generator=torch.Generator().manual_seed(7))
    for _ in range(n):
        eng.backward(eng.module(input_ids=ids, labels=ids).loss)
        eng.step()


def pickle_region(path) -> tuple[int, int]:
    """Where ``data.pkl`` (what torch's weights-only loader unpickles) lies in the zip."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    raw = path.read_bytes()[info.header_offset : info.header_offset + 30]  # the local header: its own extra length
    start = info.header_offset + 30 + int.from_bytes(raw[26:28], "little") + int.from_bytes(raw[28:30], "little")
    return start, start + info.compress_size


def test_any_damage_to_the_newest_single_checkpoint_resumes_from_one_that_verifies(tmp_path):
    base = tmp_path / "run"
    base.mkdir()
    eng = single()
    digests = {}
    for n in (1, 2):
        step(eng)
        eng.save(base, n)
        digests[n] = eng.digest()
    prev_bytes = (base / "checkpoint.prev.pt").read_bytes()
    size = (base / "checkpoint.pt").stat().st_size
    cases = damages(size, random.Random(0), flips=50, inversions=50, inside=pickle_region(base / "checkpoint.pt"))
    outcomes = {1: 0, 2: 0}
    for i, (offset, mask) in enumerate(cases):
        trial = tmp_path / f"t{i}"
        damaged_copy(base, trial, "checkpoint.pt", offset, mask)
        resumed = single()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = resumed.load(trial)  # never raises while the previous checkpoint is intact
        outcomes[got] += 1
        assert resumed.digest() == resumed.expected_digest() == digests[got], (offset, mask)
        if got == 1:  # refused: kept for inspection, out of the rotation
            assert not (trial / "checkpoint.pt").exists()
            kept = sorted(p.name for p in (trial / REFUSED).iterdir())
            assert len(kept) == 2 and kept[0].startswith("checkpoint.pt.") and kept[1].endswith(".why.txt"), kept
            step(resumed)
            resumed.save(trial, 2)  # the run goes on past the refused step...
            assert (trial / "checkpoint.prev.pt").read_bytes() == prev_bytes  # ...and the good one stays
        shutil.rmtree(trial)
    assert outcomes[1] >= len(cases) // 2, outcomes  # most damage is caught, and all of it is harmless
    (tmp_path / "outcomes.json").write_text(json.dumps(outcomes))


def test_with_every_checkpoint_damaged_the_resume_is_refused_naming_each(tmp_path):
    from dist_sr.engines.checkpoints import CheckpointCorrupt

    eng = single()
    for n in (1, 2):
        step(eng)
        eng.save(tmp_path, n)
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        start, end = pickle_region(tmp_path / name)
        data = bytearray((tmp_path / name).read_bytes())
        data[(start + end) // 2] ^= 0xFF
        (tmp_path / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="no checkpoint verifies: checkpoint.pt: .*; checkpoint.prev.pt: "):
        single().load(tmp_path)
    assert (tmp_path / "checkpoint.pt").exists() and not (tmp_path / REFUSED).exists()  # nothing moved


# -- sharded engines -----------------------------------------------------------------------------


def _sharded(kind):
    from tests.engines.test_fsdp2 import _fsdp2_engine

    if kind == "fsdp2":
        return _fsdp2_engine()
    from dist_sr.engines.deepspeed.engine import DeepSpeedEngine

    settings = TrainSettings(
        precision=PrecisionConfig("bf16-sr", seed=SEED),
        lr=1e-3,
        distributed=DistributedConfig(engine="deepspeed", zero_stage=2),
    )
    return DeepSpeedEngine(settings, tiny_qwen2())


def _sharded_worker(rank, world, kind, root, trials):
    import torch.distributed as dist

    eng = _sharded(kind)
    base = root / "run"
    digests = {}
    for n in (1, 2):
        step(eng)
        eng.save(base, n)
        digests[n] = eng.expected_digest()
    sub = base / kind
    files = sorted(str(p.relative_to(sub)) for p in (sub / "step2").rglob("*") if p.is_file())
    rng = random.Random(1)
    cases = [(f, *damages((sub / f).stat().st_size, rng, 1, 0)[0]) for f in files for _ in range(trials)]
    cases += [(f, *damages((sub / f).stat().st_size, rng, 0, 1)[0]) for f in files]
    outcomes = {1: 0, 2: 0}
    for i, (relative, offset, mask) in enumerate(cases):
        trial = root / f"t{i}"
        if rank == 0:
            damaged_copy(base, trial, f"{kind}/{relative}", offset, mask)
        dist.barrier()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = eng.load(trial)
        outcomes[got] += 1
        assert eng.expected_digest() == digests[got], (relative, offset, mask)
        assert (trial / kind / "latest").read_text().strip() == f"step{got}"
        if got == 1:
            assert not (trial / kind / "step2").exists() and any((trial / REFUSED).glob(f"{kind}-step2.*"))
            step(eng)
            eng.save(trial, 2)  # past the refused step: no "saving step 2 again" on the rerun
            assert (trial / kind / "latest").read_text().strip() == "step2"
        dist.barrier()
        if rank == 0:
            shutil.rmtree(trial)
    if rank == 0:
        (root / f"{kind}-outcomes.json").write_text(json.dumps({"files": files, "cases": len(cases), **outcomes}))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp2", "deepspeed"])
def test_any_damage_to_the_newest_sharded_checkpoint_resumes_from_one_that_verifies(kind, tmp_path):
    if kind == "deepspeed":
        pytest.importorskip("deepspeed")
    run_workers(_sharded_worker, 2, kind, tmp_path, 5)
    result = json.loads((tmp_path / f"{kind}-outcomes.json").read_text())
    assert result[str(1)] == result["cases"], result  # the manifest covers every byte of every file
