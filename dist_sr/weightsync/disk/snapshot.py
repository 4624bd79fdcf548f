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
so every version can be on disk: a restarted engine catches up from disk with
``disk.materialize`` (``dist-sr snapshot materialize``), which applies the chain to the newest
base that verifies and checks the digest of every version it reaches, stopping at the last one
that verifies. A new base
is written every ``base_every`` versions, or when the chain since the base outgrows half a base.

Engines started from a snapshot still count as pending until a sync verifies them at the
trainer's current version.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ... import collectives
from ...config import Refusal
from ...engines.checkpoints import write_manifest
from ...numerics import delta as delta_codec
from ...numerics.digest import combine, tensor_sums
from ...sources import digest_entries
from .. import auth
from ..plan import Span, TensorPlan, make_buckets

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
        write_manifest(tmp, signing_key())
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
        bases = versions(self.root, "v")
        for old in bases[: -self.keep]:
            shutil.rmtree(self.root / f"v{old}", ignore_errors=True)
        kept = bases[-self.keep :]
        for v in versions(self.root / CHAIN, "v"):
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
        write_manifest(tmp, signing_key())
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


def versions(directory: Path, prefix: str) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(
        int(p.name[len(prefix) :])
        for p in directory.iterdir()
        if p.is_dir() and p.name.startswith(prefix) and p.name[len(prefix) :].isdigit()
    )


def signing_key() -> bytes | None:
    """Snapshots are signed with the job's sync secret, which trainer and engines both hold."""
    return auth.load(required=False)
