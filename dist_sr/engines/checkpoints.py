"""Checkpoint files every engine writes the same way: atomic replaces, a bounded history, and
content digests checked on load (a manifest of file hashes, or a digest of the whole state)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from .. import faults, secret
from ..config import Refusal

KEEP_CHECKPOINTS = 2  # step directories kept under <run>/deepspeed/ and <run>/fsdp2/


def prune_checkpoints(root: Path) -> None:
    """Remove all but the newest ``KEEP_CHECKPOINTS`` complete ``step<N>`` directories."""
    done = sorted((d for d in root.glob("step*") if d.is_dir() and d.name[4:].isdigit()), key=lambda d: int(d.name[4:]))
    for old in done[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


MANIFEST = "MANIFEST.json"


class CheckpointCorrupt(Refusal, RuntimeError):
    """A checkpoint's files are not the ones written (a flipped byte, a truncated or missing file)."""

    what = "checkpoint refused"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


# The key that signs manifests: its own secret if set, else the job's weight-sync secret (which
# every trainer process of a rendered job holds, and engines, whose volume mount is read-only).
KEY_ENV = "DIST_SR_CHECKPOINT_SECRET"
SYNC_KEY_ENV = "DIST_SR_SYNC_SECRET"


def manifest_key(env=None) -> bytes | None:
    """The key of ``MANIFEST.json``'s HMAC (``DIST_SR_CHECKPOINT_SECRET``/``_FILE``, else
    ``DIST_SR_SYNC_SECRET``/``_FILE``), or None: then manifests carry SHA-256s only, which catch
    corruption but not a writer who rewrites the manifest too."""
    for name, what in ((KEY_ENV, "checkpoint secret"), (SYNC_KEY_ENV, "sync secret")):
        found = secret.read(name, what=what, env=env)
        if found is not None:
            return found[0]
    return None


def _manifest_mac(key: bytes, files: dict[str, str]) -> str:
    body = json.dumps(files, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, b"dist-sr checkpoint manifest\n" + body, hashlib.sha256).hexdigest()


def write_manifest(directory: Path, key: bytes | None = None) -> None:
    """``MANIFEST.json``: the SHA-256 of every file under ``directory`` (written last, atomically:
    a checkpoint without one did not finish), signed with ``key`` (default ``manifest_key()``)
    when there is one."""
    key = manifest_key() if key is None else key
    files = {
        str(p.relative_to(directory)): _sha256(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, MANIFEST + ".tmp")
    }
    manifest = {"sha256": files}
    if key is not None:
        manifest["hmac_sha256"] = _manifest_mac(key, files)
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1))


def verify_manifest(directory: Path, key: bytes | None = None) -> None:
    """Raise ``CheckpointCorrupt`` naming every file that is missing, extra or changed, or a
    manifest this job did not sign. With a key (default ``manifest_key()``) the manifest must
    carry its HMAC, so a process without the secret cannot make the libraries that read these
    files (PyTorch DCP, DeepSpeed, which unpickle some of them) load files of its own."""
    key = manifest_key() if key is None else key
    path = directory / MANIFEST
    if not path.exists():
        raise CheckpointCorrupt(f"{directory}: no {MANIFEST} (the checkpoint's write did not finish)")
    manifest = json.loads(path.read_text())
    want = manifest["sha256"]
    mac = manifest.get("hmac_sha256")
    if key is not None and mac is None:
        raise CheckpointCorrupt(
            f"{directory}: {MANIFEST} is not signed, but this job signs its checkpoints "
            f"({KEY_ENV} or {SYNC_KEY_ENV} is set): it was written by another process or by "
            "a run without the secret; resume it only by unsetting both, if you trust its files"
        )
    if key is None and mac is not None:
        raise CheckpointCorrupt(
            f"{directory}: {MANIFEST} is signed, but this process has no key to check it: set "
            f"{KEY_ENV} (or {SYNC_KEY_ENV}) to the secret the run was written with"
        )
    if key is not None and not hmac.compare_digest(mac, _manifest_mac(key, want)):
        raise CheckpointCorrupt(
            f"{directory}: {MANIFEST}'s signature does not match this job's secret: written by "
            f"another process, or with another {KEY_ENV}/{SYNC_KEY_ENV}; set the one it was "
            "written with"
        )
    have = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST}
    bad = sorted(set(want) ^ have) + sorted(n for n in set(want) & have if _sha256(directory / n) != want[n])
    if bad:
        raise CheckpointCorrupt(
            f"{directory}: files differ from those written: {bad[:8]}{' ...' if len(bad) > 8 else ''}"
        )


def step_dirs(root: Path) -> list[Path]:
    """Complete-looking ``step<N>`` directories under ``root``, newest first."""
    return sorted(
        (d for d in root.glob("step*") if d.is_dir() and d.name[4:].isdigit()), key=lambda d: -int(d.name[4:])
    )


REFUSED = "refused"  # <run>/refused/: checkpoints that failed to load or verify, kept for inspection


def quarantine(checkpoint: Path, run_dir: Path, reason: str) -> Path:
    """Move a refused checkpoint (a file or a step directory) to ``<run_dir>/refused/`` under a name
    that says what it was and when, with the reason beside it: it can never be loaded, rotated over
    a good checkpoint or pruned in place of one, and stays for inspection."""
    from datetime import datetime, timezone

    where = run_dir / REFUSED
    where.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    kind = checkpoint.parent.name + "-" if checkpoint.parent != run_dir else ""
    target = where / f"{kind}{checkpoint.name}.{stamp}"
    os.replace(checkpoint, target)
    faults.point("checkpoint.quarantined")
    write_atomic(where / f"{target.name}.why.txt", reason + "\n")
    return target


def choose_verified(root: Path, named: Path, rank: int) -> Path:
    """Collective: the checkpoint to resume, ``named`` (what ``latest`` names) if its files match
    their manifest, else the newest other step directory that does (with a warning naming why the
    newer ones were refused). Any failure to read or verify a candidate refuses it. Rank 0
    verifies the files once; it moves every refused candidate to ``<run>/refused/`` and points
    ``latest`` at the choice, so the run continues past the refused steps. Every rank loads the
    choice."""
    from .. import collectives

    choice: list = [None, []]
    if rank == 0:
        refused = []
        for candidate in [named] + [d for d in step_dirs(root) if d != named]:
            try:
                verify_manifest(candidate)
            except Exception as exc:  # a damaged manifest can fail in any way: the checkpoint is bad
                reason = f"{candidate.name}: {exc if isinstance(exc, CheckpointCorrupt) else repr(exc)}"
                choice[1].append(reason)
                refused.append((candidate, reason))
                continue
            choice[0] = candidate.name
            break
        if choice[0] is not None:
            for candidate, reason in refused:
                if candidate.exists():
                    quarantine(candidate, root.parent, reason)
            if named.name != choice[0]:
                write_atomic(root / "latest", choice[0])
    chosen, problems = collectives.from_first(choice)
    if chosen is None:
        raise CheckpointCorrupt(f"{root}: no checkpoint verifies: {'; '.join(problems)}")
    if problems and rank == 0:
        warnings.warn(
            f"dist_sr: resuming from {root / chosen}; refused newer (moved to {root.parent / REFUSED}): "
            f"{'; '.join(problems)}",
            RuntimeWarning,
            stacklevel=3,
        )
    return root / chosen


def state_digest(obj: Any) -> str:
    """SHA-256 over a nested state (dicts, lists, tensors, numbers, strings): names, dtypes, shapes
    and every byte, in a fixed order. Stored in a checkpoint and recomputed on load."""
    import torch

    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[" if isinstance(x, list) else b"(")
            for v in x:
                walk(v)
            h.update(b"]")
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()
