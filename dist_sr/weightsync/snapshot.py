"""Versioned snapshots of the working weights on disk, for engines that (re)start.

Dense: ``snapshot_dir/v<version>/`` is a sharded Hugging Face checkpoint (one safetensors file per
bucket, an index, the model config and tokenizer), written bucket by bucket so the trainer never
holds the whole model, with a ``MANIFEST.json`` (the SHA-256 of every file, signed with the job's
sync secret, which engines hold too: ``engines.checkpoints``). ``snapshot_dir/current`` is a
symlink switched atomically once a snapshot is complete, so an engine never starts from a
half-written one.

With deltas (``Snapshots(..., deltas=True)``), every version after a dense base is written as
``snapshot_dir/chain/v<version>/``: the grid-step deltas (``numerics.delta``) against the version
before, one file per trainer rank for the pieces it holds (``rank<r>.bin``; no gather), what they
apply to and the layout-free digest of the result (``info.json``), and a signed manifest. A
version then costs about 1/13 of a dense snapshot under SR and far less under round-to-nearest,
so every version can be on disk: a restarted engine catches up from disk with ``materialize``
(``dist-sr snapshot materialize``), which applies the chain to the newest base that verifies and
checks the digest of every version it reaches, stopping at the last one that verifies. A new base
is written every ``base_every`` versions, or when the chain since the base outgrows half a base.

Engines started from a snapshot still count as pending until a sync verifies them at the
trainer's current version.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import collectives, faults
from ..config import Refusal
from ..engines.checkpoints import MANIFEST, CheckpointCorrupt, verify_manifest, write_atomic, write_manifest
from ..numerics import delta as delta_codec
from ..numerics import warm_up_kernels
from ..numerics.digest import combine, tensor_sums
from ..sources import digest_entries
from . import auth
from .plan import Span, TensorPlan, make_buckets

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
CHAIN = "chain"
VERSION_KEY, DIGEST_KEY = "dist_sr_weight_version", "dist_sr_digest"


class SnapshotError(Refusal, RuntimeError):
    """No snapshot on disk verifies (or none exists)."""

    what = "snapshot refused"


@dataclass
class Snapshots:
    """The snapshot directory of one job. Every trainer rank of ``group`` calls ``write``: a base
    is gathered bucket by bucket and written by rank 0; a delta is written by every rank for the
    pieces it holds (no gather: ``snapshot_dir`` must be shared by the trainer's nodes, as the
    Kubernetes render's volume is). With ``deltas`` each rank keeps a host copy of the 16-bit
    pieces it holds (its share of the model) to code the next version against."""

    root: Path
    config: object = None
    tokenizer: object = None
    bucket_mb: float = 256.0
    keep: int = 2  # dense bases kept (with the chains that follow them)
    deltas: bool = False
    base_every: int = 0  # with deltas: a new base every N versions (0: when the chain outgrows half a base)
    group: object = None  # the trainer ranks' process group (default: the world)
    held: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict, repr=False)  # the last version's pieces
    held_version: int | None = None
    base_version: int | None = None
    base_bytes: int = 0
    chain_bytes: int = 0  # rank 0: bytes of the deltas since the base, all ranks

    def __post_init__(self):
        self.root = Path(self.root)

    def write(self, source, version: int) -> Path | None:
        """Write ``version``, as a delta when one is due; returns its directory on rank 0."""
        metas = source.metadata()
        hold = self.deltas and all(d in ("bfloat16", "float16") for _, d, _ in metas)
        if hold and collectives.from_first(self._delta_due(version), self.group):
            try:
                return self._write_delta(source, version, metas)
            except BaseException:
                self.held, self.held_version = {}, None  # a delta half-written: the next version is a base
                raise
        return self._write_base(source, version, metas, hold=hold)

    def _delta_due(self, version: int) -> bool:
        """Rank 0's choice (the others follow it)."""
        if self.held_version is None or self.base_version is None:
            return False
        if self.base_every and version - self.base_version >= self.base_every:
            return False
        return 2 * self.chain_bytes <= self.base_bytes

    def _hold_pieces(self, source, metas) -> None:
        for p in source.local_pieces([m[0] for m in metas]):
            if p.end > p.start:
                flat, key = p.bits.detach().reshape(-1), (p.name, p.start)
                held = self.held.get(key)
                if held is None or held.shape != flat.shape or held.dtype != flat.dtype:
                    self.held[key] = flat.to("cpu", copy=True)
                else:
                    held.copy_(flat)

    # ---- a dense base (rank 0 writes) --------------------------------------------------------
    def _write_base(self, source, version: int, metas, *, hold: bool) -> Path | None:
        from safetensors.torch import save_file

        rank = collectives.rank(self.group)
        plans = [TensorPlan(n, d, tuple(s), [Span(0, 0, 0)]) for n, d, s in metas]
        buckets = [[t.name for t in b.tensors] for b in make_buckets(plans, int(self.bucket_mb * 2**20))]
        final, tmp = self.root / f"v{version}", self.root / f".v{version}.partial"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.held, self.held_version = {}, None
        weight_map, entries, nbytes = {}, {}, 0
        for i, names in enumerate(buckets):
            full = source.gather(names)  # a collective on every rank
            if rank != 0:
                continue
            fname = f"model-{i + 1:05d}-of-{len(buckets):05d}.safetensors"
            save_file({n: full[n].contiguous() for n in names}, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in names})
            entries.update(tensor_sums(full))
            nbytes += sum(full[n].numel() * full[n].element_size() for n in names)
        if hold:
            self._hold_pieces(source, metas)
            self.held_version = version
        self.base_version, self.chain_bytes = version, 0
        if rank != 0:
            return None
        self.base_bytes = nbytes
        metadata = {VERSION_KEY: version, DIGEST_KEY: combine(entries)}
        (tmp / INDEX).write_text(json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=1))
        self._write_model_files(tmp, metas)
        write_manifest(tmp, _key())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        link = self.root / ".current.tmp"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(final.name)
        os.replace(link, self.root / "current")  # atomic switch
        self._prune()
        return final

    def _write_model_files(self, directory: Path, metas) -> None:
        if self.config is not None:
            self.config.save_pretrained(directory)
            cfg = json.loads((directory / "config.json").read_text())
            dtypes = {d for _, d, _ in metas}
            if len(dtypes) == 1:  # serve in the dtype of the working weights (the trainer loads FP32 configs)
                cfg["dtype"] = cfg["torch_dtype"] = dtypes.pop()
            (directory / "config.json").write_text(json.dumps(cfg, indent=2))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)

    def _prune(self) -> None:
        """Keep the newest ``keep`` bases and the chain entries after the oldest of them."""
        bases = _versions(self.root, "v")
        for old in bases[: -self.keep]:
            shutil.rmtree(self.root / f"v{old}", ignore_errors=True)
        kept = bases[-self.keep :]
        for v in _versions(self.root / CHAIN, "v"):
            if not kept or v <= kept[0]:
                shutil.rmtree(self.root / CHAIN / f"v{v}", ignore_errors=True)

    # ---- a delta (every rank writes its pieces) ----------------------------------------------
    def _write_delta(self, source, version: int, metas) -> Path | None:
        rank, world = collectives.rank(self.group), collectives.world(self.group)
        final, tmp = self.root / CHAIN / f"v{version}", self.root / CHAIN / f".v{version}.partial"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        collectives.barrier(self.group)  # the directory exists for every rank
        pieces, problem = [], ""
        try:
            with open(tmp / f"rank{rank:05d}.bin", "wb") as out:
                for p in source.local_pieces([m[0] for m in metas]):
                    if p.end > p.start:
                        blob = delta_codec.encode(self.held[(p.name, p.start)], p.bits.detach().cpu()).to_bytes()
                        out.write(blob)
                        pieces.append([p.name, p.start, p.end, len(blob)])
        except (OSError, KeyError, delta_codec.DeltaError) as exc:
            problem = f"trainer rank {rank}: {exc}"
        entries = digest_entries(source, world, self.group)  # collective: the layout-free digest
        problems = collectives.gathered(problem, self.group)
        if any(problems):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise SnapshotError(f"snapshot delta of version {version} not written: {[p for p in problems if p]}")
        self._hold_pieces(source, metas)
        previous, self.held_version = self.held_version, version
        by_rank = collectives.gathered(pieces, self.group)
        if rank != 0:
            return None
        info = {"version": version, "previous": previous, "digest": combine(entries), "ranks": by_rank}
        (tmp / "info.json").write_text(json.dumps(info, indent=1))
        write_manifest(tmp, _key())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self.chain_bytes += sum(p[3] for ps in by_rank for p in ps)
        return final


def write_snapshot(
    source,
    snapshot_dir: str | Path,
    version: int,
    *,
    config=None,
    tokenizer=None,
    bucket_mb: float = 256.0,
    keep: int = 2,
) -> Path | None:
    """A dense snapshot of ``version`` (every trainer rank; rank 0 writes and gets its directory)."""
    return Snapshots(Path(snapshot_dir), config, tokenizer, bucket_mb, keep).write(source, version)


# ---- catching up from disk ---------------------------------------------------------------------
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
    """Write the newest version the snapshots can prove to ``out`` (a dense HF checkpoint an
    engine serves): the newest base whose manifest, digest and version (its signed index against
    its directory name) verify, then its chain of deltas in order, each checked (manifest, its
    signed version against its name, continuity, the digest of the result), stopping before the
    first that fails. Raises ``SnapshotError`` when no base verifies.

    ``out`` is refused before anything is touched when it is the snapshot directory, inside it or
    holds it, is a symlink, a file, or a directory holding files ``materialize`` did not write
    (``OutputRefused``); an OS error on the way is one refusal naming the path and the fix. Runs
    into one ``out`` take turns (a lock on its parent directory), each staging under a name of its
    own, so every run ends in a complete, verified checkpoint or a refusal. Digests and deltas take
    the C++ kernels where they build (the torch paths give the same bits, ~10x slower)."""
    given, root = str(out), Path(snapshot_dir)
    try:
        target = _check_out(root, given)
    except OSError as exc:  # a path that cannot even be looked at
        raise _os_refusal(exc, Path(given)) from None
    try:
        if not _versions(root, "v"):
            raise SnapshotError(f"no snapshot under {root} verifies: there is none yet")
        for why in warm_up_kernels():
            log.info("snapshot: the torch path stands in for %s", why)
        with _Turn(target):
            tensors, index, m = _newest_provable(root, target)
            _staged_write(root / f"v{m.base}", index, tensors, target, m.version, m.digest)
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


def _newest_provable(root: Path, out: Path) -> tuple[dict[str, torch.Tensor], dict, Materialized]:
    refused: list[str] = []
    for base in reversed(_versions(root, "v")):
        try:
            tensors, index = _load_base(root / f"v{base}", base)
        except (CheckpointCorrupt, SnapshotError, OSError, ValueError, KeyError, TypeError) as exc:
            refused.append(f"base v{base}: {exc}")
            continue
        version, digest, good = base, index["metadata"][DIGEST_KEY], []
        for v in _versions(root / CHAIN, "v"):
            if v <= base:
                continue
            entry = root / CHAIN / f"v{v}"
            try:
                digest = _apply_chain_entry(entry, tensors, version)
            except (
                CheckpointCorrupt,
                SnapshotError,
                delta_codec.DeltaError,
                OSError,
                ValueError,
                KeyError,
                TypeError,
            ) as exc:
                refused.append(f"delta v{v}: {exc}")
                # it may have changed tensors part-way: replay the base and the entries that verified
                tensors, _ = _load_base(root / f"v{base}", base)
                previous = base
                for e in good:
                    _apply_chain_entry(e, tensors, previous)
                    previous = int(e.name[1:])
                break
            version = v
            good.append(entry)
        return tensors, index, Materialized(out, version, digest, base, len(good), tuple(refused))
    raise SnapshotError(
        f"no snapshot under {root} verifies: " + ("; ".join(refused) if refused else "there is none yet")
    )


def _load_base(directory: Path, version: int) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    verify_manifest(directory, _key())
    index = json.loads((directory / INDEX).read_text())
    _check_version(directory, index["metadata"].get(VERSION_KEY), version)
    tensors: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(directory / fname)))
    if set(tensors) != set(index["weight_map"]):
        raise SnapshotError(f"{directory}: the files hold other tensors than the index names")
    got = combine(tensor_sums(tensors))
    if got != index["metadata"].get(DIGEST_KEY):
        raise SnapshotError(f"{directory}: the weights' digest {got[:16]} is not the one recorded")
    return tensors, index


def _check_version(directory: Path, signed, named: int) -> None:
    """The version inside a signed entry must be the one its name and place in the chain give it:
    a renamed or copied entry would otherwise be served under a version it is not."""
    if not isinstance(signed, int) or isinstance(signed, bool) or signed != named:
        raise SnapshotError(
            f"{directory}: its signed files say version {signed!r}, its name says {named}: a renamed or copied "
            "snapshot, not served; remove it (the trainer writes every version under its own name)"
        )


def _apply_chain_entry(directory: Path, tensors: dict[str, torch.Tensor], version: int) -> str:
    """Apply one chain entry to ``tensors`` (which hold ``version``); returns the new digest."""
    verify_manifest(directory, _key())
    info = json.loads((directory / "info.json").read_text())
    _check_version(directory, info["version"], int(directory.name[1:]))
    if info["previous"] != version:
        raise SnapshotError(f"{directory.name} applies to version {info['previous']}, not to {version}")
    for rank, pieces in enumerate(info["ranks"]):
        blob = torch.frombuffer(bytearray((directory / f"rank{rank:05d}.bin").read_bytes()), dtype=torch.uint8)
        offset = 0
        for name, start, end, size in pieces:
            d, after = delta_codec.read_delta(blob, offset)
            if after - offset != size or name not in tensors or not 0 <= start < end <= tensors[name].numel():
                raise SnapshotError(f"{directory.name}: rank {rank}'s delta of {name}[{start}:{end}] does not fit")
            delta_codec.apply_(tensors[name].view(-1)[start:end], d)
            offset = after
        if offset != blob.numel():
            raise SnapshotError(f"{directory.name}: {blob.numel() - offset} bytes after rank {rank}'s last delta")
    digest = combine(tensor_sums(tensors))
    if digest != info["digest"]:
        raise SnapshotError(f"{directory.name}: the result's digest {digest[:16]} is not the one recorded")
    return digest


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


def _staged_write(base_dir: Path, index: dict, tensors, out: Path, version: int, digest: str) -> None:
    """The checkpoint written under a staging name of this run's, then moved to ``out`` (the old
    checkpoint, one ``materialize`` wrote, moved aside and removed). OS errors are refusals."""
    run = f"{os.getpid()}-{os.urandom(4).hex()}"
    tmp, old = (out.with_name(f".{out.name}{STAGING}{run}.{kind}") for kind in ("partial", "old"))
    from safetensors import SafetensorError

    try:
        tmp.mkdir()
        _write_dense(base_dir, index, tensors, tmp, version, digest)
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
    verify_manifest(out, _key())  # what an engine will read is what was written


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


def _write_dense(base_dir: Path, index: dict, tensors, directory: Path, version: int, digest: str) -> None:
    from safetensors.torch import save_file

    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for name, fname in index["weight_map"].items():
        by_file.setdefault(fname, {})[name] = tensors[name]
    for fname, named in by_file.items():
        save_file(named, str(directory / fname), metadata={"format": "pt"})
    for p in base_dir.iterdir():  # config, tokenizer
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (INDEX, MANIFEST):
            shutil.copy2(p, directory / p.name)
    meta = {VERSION_KEY: version, DIGEST_KEY: digest}
    write_atomic(directory / INDEX, json.dumps({"metadata": meta, "weight_map": index["weight_map"]}, indent=1))
    write_manifest(directory, _key())


def _versions(directory: Path, prefix: str) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(
        int(p.name[len(prefix) :])
        for p in directory.iterdir()
        if p.is_dir() and p.name.startswith(prefix) and p.name[len(prefix) :].isdigit()
    )


def _key() -> bytes | None:
    """Snapshots are signed with the job's sync secret, which trainer and engines both hold."""
    return auth.load(required=False)
