"""``dist-sr snapshot materialize DIR OUT``: the newest weight version the snapshots in ``DIR``
prove, written to ``OUT`` as a dense checkpoint an engine serves.

The newest dense base whose manifest, version and digest verify, then its chain of deltas in
order, each checked (manifest, its signed version against its name, continuity, the digest of the
result), stopping before the first that fails. Everything streams a tensor at a time: a tensor is
read from the base (``safetensors``' lazy reads), every delta of the chain that touches it is
applied, and its digest sum after each version is kept (two integers per tensor and version), so
the proof takes one tensor of memory; the checkpoint is then written one output file (a bucket of
the base, 256 MiB by default) at a time, the deltas that verified applied again on the way (a
base with no deltas to apply is copied file by file). Memory: one tensor while proving, one
output file while writing, never the model.

``OUT`` is refused before anything is touched when it is the snapshot directory, inside it or
holds it, is a symlink, a file, or a directory holding files ``materialize`` did not write
(``OutputRefused``); an OS error on the way is one refusal naming the path and the fix. Runs into
one ``OUT`` take turns (a lock on its parent directory), each staging under a name of its own, so
every run ends in a complete, verified checkpoint or a refusal.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import faults
from ...engines.checkpoints import MANIFEST, CheckpointCorrupt, verify_manifest, write_atomic, write_manifest
from ...numerics import delta as delta_codec
from ...numerics import warm_up_kernels
from ...numerics.digest import MASK64, combine, dtype_name, piece_sum
from .snapshot import CHAIN, DIGEST_KEY, INDEX, VERSION_KEY, SnapshotError, signing_key, versions

log = logging.getLogger(__name__)

# what reading a snapshot can raise where a file is bad: that base or delta is refused, not the run
_BAD = (CheckpointCorrupt, SnapshotError, delta_codec.DeltaError, OSError, ValueError, KeyError, TypeError)


@dataclass(frozen=True)
class Materialized:
    """What ``materialize`` wrote: the version reached, its digest, the base it started from, the
    deltas applied, and what was refused on the way (one line each)."""

    path: Path
    version: int
    digest: str
    base: int
    deltas: int
    refused: tuple[str, ...] = ()


class OutputRefused(SnapshotError):
    """``materialize``'s OUT cannot be written, or writing it would destroy what it did not write."""

    what = "materialize refused"


def materialize(snapshot_dir: str | Path, out: str | Path) -> Materialized:
    """Write the newest version the snapshots under ``snapshot_dir`` can prove to ``out``. Raises
    ``SnapshotError`` when no base verifies, ``OutputRefused`` for an ``out`` it must not write.
    Digests and deltas take the compiled kernels where they are built (the torch paths give the
    same bits, slower)."""
    given, root = str(out), Path(snapshot_dir)
    try:
        target = _check_out(root, given)
    except OSError as exc:  # a path that cannot even be looked at
        raise _os_refusal(exc, Path(given)) from None
    try:
        if not versions(root, "v"):
            raise SnapshotError(f"no snapshot under {root} verifies: there is none yet")
        for why in warm_up_kernels():
            log.info("snapshot: the torch path stands in for %s", why)
        with _Turn(target):
            base, chain, m = _newest_provable(root, target)
            _staged_write(base, chain, target, m)
    except PermissionError as exc:
        if exc.filename and Path(exc.filename).is_relative_to(root):
            raise SnapshotError(
                f"cannot read {exc.filename}: {exc.strerror}; run materialize as a user who can read the "
                "snapshot directory (engines mount it read-only)"
            ) from None
        raise _os_refusal(exc, target) from None
    for r in m.refused:
        log.warning("snapshot: %s", r)
    return m


# ---- proving a version, a tensor at a time ------------------------------------------------------
@dataclass(frozen=True)
class _Base:
    directory: Path
    version: int
    index: dict  # its signed index: {"metadata": ..., "weight_map": {name: file}}


@dataclass(frozen=True)
class _Entry:
    """One chain entry: the version it makes, and where each delta of a tensor lies in its files."""

    directory: Path
    version: int
    digest: str
    pieces: dict[str, list[tuple[Path, int, int, int, int]]]  # name -> (file, offset, size, start, end)


def _newest_provable(root: Path, out: Path) -> tuple[_Base, list[_Entry], Materialized]:
    refused: list[str] = []
    for version in reversed(versions(root, "v")):
        try:
            base = _open_base(root / f"v{version}", version)
        except _BAD as exc:
            refused.append(f"base v{version}: {exc}")
            continue
        chain = _open_chain(root, base, refused)
        try:
            good, digest = _prove(base, chain, refused)
        except _BAD as exc:  # the base's own tensors do not verify
            refused.append(f"base v{version}: {exc}")
            continue
        reached = good[-1].version if good else version
        return base, good, Materialized(out, reached, digest, version, len(good), tuple(refused))
    raise SnapshotError(
        f"no snapshot under {root} verifies: " + ("; ".join(refused) if refused else "there is none yet")
    )


def _open_base(directory: Path, version: int) -> _Base:
    verify_manifest(directory, signing_key())
    index = json.loads((directory / INDEX).read_text())
    _check_version(directory, index["metadata"].get(VERSION_KEY), version)
    files = sorted(set(index["weight_map"].values()))
    held = set()
    from safetensors import safe_open

    for fname in files:
        with safe_open(str(directory / fname), framework="pt") as f:
            held.update(f.keys())
    if held != set(index["weight_map"]):
        raise SnapshotError(f"{directory}: the files hold other tensors than the index names")
    return _Base(directory, version, index)


def _open_chain(root: Path, base: _Base, refused: list[str]) -> list[_Entry]:
    """The chain entries after ``base`` whose manifest, signed version and continuity verify, in
    order, up to the first that does not (refused, with those after it)."""
    out: list[_Entry] = []
    previous = base.version
    for v in versions(root / CHAIN, "v"):
        if v <= base.version:
            continue
        directory = root / CHAIN / f"v{v}"
        try:
            out.append(_open_entry(directory, previous, base))
        except _BAD as exc:
            refused.append(f"delta v{v}: {exc}")
            break
        previous = v
    return out


def _open_entry(directory: Path, previous: int, base: _Base) -> _Entry:
    verify_manifest(directory, signing_key())
    info = json.loads((directory / "info.json").read_text())
    version = int(directory.name[1:])
    _check_version(directory, info["version"], version)
    if info["previous"] != previous:
        raise SnapshotError(f"{directory.name} applies to version {info['previous']}, not to {previous}")
    pieces: dict[str, list[tuple[Path, int, int, int, int]]] = {}
    for rank, listed in enumerate(info["ranks"]):
        path = directory / f"rank{rank:05d}.bin"
        size, offset = path.stat().st_size, 0
        for name, start, end, nbytes in listed:
            if name not in base.index["weight_map"] or not 0 <= start < end or nbytes <= 0:
                raise SnapshotError(f"{directory.name}: rank {rank}'s delta of {name}[{start}:{end}] does not fit")
            pieces.setdefault(name, []).append((path, offset, nbytes, start, end))
            offset += nbytes
        if offset != size:
            raise SnapshotError(f"{directory.name}: {size - offset} bytes after rank {rank}'s last delta")
    return _Entry(directory, version, str(info["digest"]), pieces)


def _tensors(base: _Base, names: list[str]):
    """``(name, tensor)`` of ``names`` read from the base a tensor at a time."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(base.index["weight_map"][n], []).append(n)
    for fname, in_file in by_file.items():
        with safe_open(str(base.directory / fname), framework="pt") as f:
            for n in in_file:
                yield n, f.get_tensor(n)


def _apply(entry: _Entry, name: str, tensor: torch.Tensor) -> None:
    """The deltas of ``entry`` for ``name``, applied to ``tensor`` in place."""
    flat = tensor.view(-1)
    for path, offset, nbytes, start, end in entry.pieces.get(name, ()):
        if end > flat.numel():
            raise SnapshotError(f"{entry.directory.name}: a delta of {name}[{start}:{end}] does not fit")
        with open(path, "rb") as f:
            f.seek(offset)
            raw = f.read(nbytes)
        if len(raw) != nbytes:
            raise SnapshotError(f"{entry.directory.name}: {path.name} ends inside the delta of {name}")
        d, after = delta_codec.read_delta(torch.frombuffer(bytearray(raw), dtype=torch.uint8), 0)
        if after != nbytes:
            raise SnapshotError(f"{entry.directory.name}: the delta of {name}[{start}:{end}] does not fit")
        delta_codec.apply_(flat[start:end], d)


def _prove(base: _Base, chain: list[_Entry], refused: list[str]) -> tuple[list[_Entry], str]:
    """Stream every tensor through the chain, summing its digest after the base and after each
    entry; returns the entries whose results verify (the chain up to the first that does not)
    and the digest reached. Raises if the base's own digest does not verify."""
    names = sorted(base.index["weight_map"])
    sums: list[dict[str, tuple[str, tuple[int, ...], int]]] = [{} for _ in range(len(chain) + 1)]
    usable = len(chain)  # entries that applied without an error, so far
    for name, tensor in _tensors(base, names):
        entry = (dtype_name(tensor.dtype), tuple(tensor.shape))
        sums[0][name] = (*entry, piece_sum(tensor.reshape(-1), 0) & MASK64)
        for k, e in enumerate(chain[:usable]):
            try:
                _apply(e, name, tensor)
            except _BAD as exc:
                refused.append(f"delta v{e.version}: {exc}")
                usable = k
                break
            sums[k + 1][name] = (*entry, piece_sum(tensor.reshape(-1), 0) & MASK64)
    got = combine(sums[0])
    if got != base.index["metadata"].get(DIGEST_KEY):
        raise SnapshotError(f"{base.directory}: the weights' digest {got[:16]} is not the one recorded")
    digest = got
    for k, e in enumerate(chain[:usable]):
        got = combine(sums[k + 1])
        if got != e.digest:
            refused.append(
                f"delta v{e.version}: {e.directory.name}: the result's digest {got[:16]} is not the one recorded"
            )
            return chain[:k], digest
        digest = got
    if usable < len(chain):
        return chain[:usable], digest
    return chain, digest


def _check_version(directory: Path, signed, named: int) -> None:
    """The version inside a signed entry must be the one its name and place in the chain give it:
    a renamed or copied entry would otherwise be served under a version it is not."""
    if not isinstance(signed, int) or isinstance(signed, bool) or signed != named:
        raise SnapshotError(
            f"{directory}: its signed files say version {signed!r}, its name says {named}: a renamed or copied "
            "snapshot, not served; remove it (the trainer writes every version under its own name)"
        )


# ---- where materialize writes ------------------------------------------------------------------
STAGING = ".materialize-"  # ``.<OUT name>.materialize-<run>.partial|.old``: a run's own files beside OUT


def _check_out(root: Path, given: str) -> Path:
    """OUT as an absolute path (its parent's symlinks resolved), or ``OutputRefused`` before
    anything is touched: OUT must name a directory entry of its own, apart from the snapshots, and
    may only replace a checkpoint ``materialize`` wrote."""
    out = Path(given)
    if not given or out.name in ("", ".."):
        raise OutputRefused(
            f"OUT {given!r} names no directory of its own (the current directory, a parent or the root), which "
            "materialize would replace whole: give a new path such as ./engine-weights"
        )
    target = Path(os.path.abspath(out))
    target = target.parent.resolve() / target.name
    src = root.resolve()
    if target == src or src in target.parents or _same_as_any(src, target):
        raise OutputRefused(
            f"OUT {target} is the snapshot directory {src} or inside it: materialize reads DIR and replaces OUT "
            "whole; write OUT outside DIR"
        )
    if target in src.parents or _same_as_any(target, src):
        raise OutputRefused(
            f"OUT {target} holds the snapshot directory {src}: replacing OUT would delete the snapshots; give a "
            "new directory outside DIR"
        )
    if target.is_symlink():
        raise OutputRefused(
            f"OUT {target} is a symlink (to {os.readlink(target)}): materialize replaces OUT whole; give a real "
            "path of its own"
        )
    if target.exists():
        if not target.is_dir():
            raise OutputRefused(
                f"OUT {target} is a file that materialize did not write: remove it or choose another OUT"
            )
        foreign = _not_ours(target)
        if foreign:
            raise OutputRefused(
                f"OUT {target} holds files materialize did not write ({', '.join(foreign[:3])}"
                f"{' ...' if len(foreign) > 3 else ''}), which replacing it would delete: give an empty or new "
                "directory"
            )
    return target


def _same_as_any(a: Path, b: Path) -> bool:
    """Whether ``a`` is ``b`` or one of its ancestors on disk (a bind mount or a second name of the
    same directory, which resolving symlinks does not see)."""
    try:
        ident = os.stat(a)
    except OSError:
        return False
    for p in (b, *b.parents):
        try:
            st = os.stat(p)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (ident.st_dev, ident.st_ino):
            return True
    return False


def _not_ours(directory: Path) -> list[str]:
    """Files in ``directory`` that a checkpoint written by ``materialize`` does not list (all of
    them when it is not one): its manifest names every file it wrote."""
    have = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if not p.is_dir())
    if not have:
        return []  # an empty directory
    try:
        listed = set(json.loads((directory / MANIFEST).read_text())["sha256"])
        meta = json.loads((directory / INDEX).read_text())["metadata"]
        if VERSION_KEY not in meta or DIGEST_KEY not in meta:
            return have
    except (OSError, ValueError, KeyError, TypeError):
        return have
    return [f for f in have if f not in listed and f != MANIFEST]


class _Turn:
    """An exclusive ``flock`` on OUT's parent directory for a whole run (created if missing):
    concurrent runs into one OUT (engines restarted together) take turns instead of sharing
    staging files. The kernel drops it when its holder dies; what a dead run left beside OUT
    (``.<name>.materialize-*``) is removed once the lock is held."""

    def __init__(self, out: Path):
        self.out = out

    def __enter__(self):
        import fcntl

        parent = self.out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise _os_refusal(exc, self.out) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            for stale in parent.iterdir():
                if stale.name.startswith(f".{self.out.name}{STAGING}"):
                    shutil.rmtree(stale, ignore_errors=True)
        except OSError as exc:
            os.close(self.fd)
            raise _os_refusal(exc, self.out) from None
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # releases the flock
        return False


def _staged_write(base: _Base, chain: list[_Entry], out: Path, m: Materialized) -> None:
    """The checkpoint written under a staging name of this run's, then moved to ``out`` (the old
    checkpoint, one ``materialize`` wrote, moved aside and removed). OS errors are refusals."""
    run = f"{os.getpid()}-{os.urandom(4).hex()}"
    tmp, old = (out.with_name(f".{out.name}{STAGING}{run}.{kind}") for kind in ("partial", "old"))
    from safetensors import SafetensorError

    try:
        tmp.mkdir()
        _write_dense(base, chain, tmp, m.version, m.digest)
        faults.point("materialize.staged")
        if out.exists():
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except OSError:
                os.replace(old, out)  # put the previous checkpoint back
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _os_refusal(exc, out) from None
    except SafetensorError as exc:  # safetensors' own I/O errors (a full disk)
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputRefused(f"cannot write the checkpoint under {out.parent}: {exc}; free space there") from None
    verify_manifest(out, signing_key())  # what an engine will read is what was written


_OS_FIXES = {
    errno.EACCES: "make it writable by this user, or choose an OUT elsewhere",
    errno.EPERM: "make it writable by this user, or choose an OUT elsewhere",
    errno.EROFS: "its file system is read-only: choose an OUT on a writable volume",
    errno.ENOSPC: "free space there, or choose an OUT on another volume",
    errno.EDQUOT: "free space there, or choose an OUT on another volume",
    errno.ENOTDIR: "a file is in the way of a directory on that path: remove it or choose another OUT",
    errno.EEXIST: "a file is in the way on that path: remove it or choose another OUT",
    errno.ENOTEMPTY: "a directory is in the way on that path: remove it or choose another OUT",
    errno.EISDIR: "a directory is in the way on that path: remove it or choose another OUT",
    errno.EBUSY: "OUT is a mount point or in use: give a directory inside it",
    errno.EXDEV: "OUT is a mount point: give a directory inside it",
}


def _os_refusal(exc: OSError, out: Path) -> OutputRefused:
    where = Path(exc.filename) if exc.filename else out
    if where.name.startswith(f".{out.name}{STAGING}"):
        where = where.parent  # this run's staging name: the directory it could not write in is the problem
    fix = _OS_FIXES.get(exc.errno or 0, "fix that path, or choose another OUT")
    return OutputRefused(f"cannot write {where} (OUT {out}): {exc.strerror or exc}; {fix}")


def _write_dense(base: _Base, chain: list[_Entry], directory: Path, version: int, digest: str) -> None:
    """The base's files with ``chain`` applied, one output file in memory at a time (the base's
    files copied as they are where no delta touches them)."""
    from safetensors.torch import save_file

    weight_map = base.index["weight_map"]
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_file.setdefault(fname, []).append(name)
    touched = {n for e in chain for n in e.pieces}
    for fname, names in by_file.items():
        if not touched & set(names):
            shutil.copyfile(base.directory / fname, directory / fname)  # verified by the base's manifest
            continue
        named = {}
        for name, tensor in _tensors(base, names):
            for e in chain:
                _apply(e, name, tensor)
            named[name] = tensor
        save_file(named, str(directory / fname), metadata={"format": "pt"})
        del named
    for p in base.directory.iterdir():  # config, tokenizer
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (INDEX, MANIFEST):
            shutil.copy2(p, directory / p.name)
    written = combine(
        {
            n: (dtype_name(t.dtype), tuple(t.shape), piece_sum(t.reshape(-1), 0))
            for n, t in _tensors(_Base(directory, version, base.index), sorted(weight_map))
        }
    )
    if written != digest:  # read twice (proved, then written): a file changed under it in between
        raise SnapshotError(
            f"{base.directory}: the checkpoint written holds digest {written[:16]}, not the {digest[:16]} proved: "
            "the snapshot changed while it was read; run materialize again"
        )
    meta = {VERSION_KEY: version, DIGEST_KEY: digest}
    write_atomic(directory / INDEX, json.dumps({"metadata": meta, "weight_map": weight_map}, indent=1))
    write_manifest(directory, signing_key())
