"""Fault injection: a trainer SIGKILLed at chosen points of a checkpoint write, a metrics write or
a weight sync (``dist_sr.faults``) resumes from a complete checkpoint, and the run it finishes is
the run that was never interrupted, record for record; a receiver left mid-sync never counts as
holding verified weights."""

import os
import random
import subprocess
import sys

import pytest
import torch
import yaml

from dist_sr.rl.config import to_dict
from dist_sr.rl.metrics import read_metrics
from dist_sr.rl.warmup import warmup_checkpoint
from dist_sr.rollout.vllm.control import VLLMControl
from dist_sr.testing.vllm_engines import REPO, free_port, start_receiver
from tests.engines.test_checkpoint_fuzz import pickle_region

pytestmark = pytest.mark.slow
STEPS, EVERY = 6, 2  # checkpoints after steps 2, 4, 6
# (point, hit): the new checkpoint written but not in place; the old one moved aside and the new
# one not yet in place (only checkpoint.prev.pt holds the newest complete state); just after a
# save; a record written past the newest checkpoint (resuming must drop it, then write it again).
KILLS = [("checkpoint.written", 2), ("checkpoint.rotated", 2), ("checkpoint.done", 1), ("metrics.written", 6)]


def _run(config, fault=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DIST_SR_FAULT", None)
    if fault:
        env["DIST_SR_FAULT"] = fault
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "dist_sr.launch.cli",
            "train",
            "--config",
            str(config),
            "--resume-or-start",
            "--no-progress",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _records(run_dir):
    return [{k: v for k, v in r.items() if k != "step_time"} for r in read_metrics(run_dir / "metrics.jsonl")]


def test_a_trainer_killed_in_any_checkpoint_or_metrics_write_finishes_the_same_run(easy, tmp_path):
    start = warmup_checkpoint(easy(), progress=False)

    def config(name):
        cfg = easy(
            precision="bf16-sr",
            output_dir=str(tmp_path / name),
            threads=1,
            **{
                "model.path": str(start),
                "warmup.enabled": False,
                "grpo.steps": STEPS,
                "checkpoint_every": EVERY,
                "eval.every": 3,
            },
        )
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return path

    ref = _run(config("straight"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    straight = _records(tmp_path / "straight")
    assert [r["step"] for r in straight] == list(range(STEPS + 1))
    for i, (point, k) in enumerate(KILLS):
        name = f"killed-{i}"
        cfg = config(name)
        first = _run(cfg, f"{point}:{k}")
        assert first.returncode == -9, (point, k, first.stderr[-3000:])  # died there, without cleanup
        saved = [torch.load(f, weights_only=True)["step"] for f in (tmp_path / name).glob("checkpoint*.pt")]
        second = _run(cfg)
        assert second.returncode == 0, (point, k, second.stderr[-3000:])
        # from the newest complete checkpoint (the one moved aside, when the new one was not yet in place)
        expected = f"resuming {tmp_path / name} from step {max(saved)}" if saved else "starting fresh"
        assert expected in second.stdout, (point, k, saved, second.stdout[-2000:])
        assert _records(tmp_path / name) == straight, (point, k)  # no gap, no duplicate, same numbers

    # a damaged newest checkpoint, then kills at the fallback's rotation points: moving the refused
    # one aside, and the first save after it; every resume takes the good one and the run ends the same
    cfg = config("damaged")
    assert _run(cfg, "metrics.written:6").returncode == -9  # after step 5: checkpoint.pt = 4, prev = 2
    newest = tmp_path / "damaged" / "checkpoint.pt"
    data = bytearray(newest.read_bytes())
    start, end = pickle_region(newest)
    data[(start + end) // 2] ^= 0xFF  # inside the pickle torch's weights-only loader reads
    newest.write_bytes(bytes(data))
    for fault in ("checkpoint.quarantined:1", "checkpoint.rotated:1", None):
        r = _run(cfg, fault)
        assert r.returncode == (-9 if fault else 0), (fault, r.stderr[-3000:])
        if fault != "checkpoint.quarantined:1":  # (that one dies while loading, before it says where it resumes)
            assert f"resuming {tmp_path / 'damaged'} from step 2" in r.stdout, (fault, r.stdout[-2000:])
        if fault:  # the good checkpoint was never rotated away
            assert torch.load(tmp_path / "damaged" / "checkpoint.prev.pt", weights_only=True)["step"] == 2
    assert _records(tmp_path / "damaged") == straight
    kept = [p.name for p in (tmp_path / "damaged" / "refused").iterdir() if not p.name.endswith(".why.txt")]
    assert len(kept) == 1 and kept[0].startswith("checkpoint.pt."), kept  # the damaged one, kept for inspection


SYNC = """
import sys, torch
from dist_sr.rollout.vllm.control import controls
from dist_sr.sources import ReplicatedSource
from dist_sr.weightsync.trainer.sync import WeightSync
url, port, version = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(version)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(12)]).to(torch.bfloat16)  # 24 buckets
ws = WeightSync(ReplicatedSource(model), controls([url], 10), bucket_mb=0.002, timeout_s=10, group_port=port)
r = ws.sync(version)
print(r.digest, r.ready)
"""


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_trainer_killed_mid_sync_leaves_no_engine_claiming_verified_weights(seed, tmp_path):
    receiver, url = start_receiver()
    try:

        def sync(version, fault=None):
            env = {**os.environ, **({"DIST_SR_FAULT": fault} if fault else {})}
            return subprocess.run(
                [sys.executable, "-c", SYNC, url, str(free_port()), str(version)],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )

        done = sync(1)
        assert done.returncode == 0, done.stderr[-3000:]
        (verified,) = VLLMControl(url, 10).report()
        assert verified["complete"] and verified["version"] == 1
        killed = sync(2, f"sync.bucket:{random.Random(seed).randint(1, 20)}")
        assert killed.returncode == -9, killed.stderr[-3000:]
        (left,) = VLLMControl(url, 10).report()
        assert not left["complete"]  # part of version 2 over version 1: it says so, and no trainer would verify it
        again = sync(3)  # a restarted trainer: new store, new groups, the receiver rejoins and is verified
        assert again.returncode == 0, again.stderr[-3000:]
        digest, ready = again.stdout.split(" ", 1)
        (final,) = VLLMControl(url, 10).report()
        assert final["complete"] and final["version"] == 3 and url in ready
    finally:
        receiver.kill()
        receiver.wait()
