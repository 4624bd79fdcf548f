"""Versioned safetensors snapshots of the working weights, for engines that (re)start.

``snapshot_dir/v<version>/`` is a sharded Hugging Face checkpoint (one safetensors file per
bucket, an index, the model config and tokenizer), written bucket by bucket so the trainer never
holds the whole model; ``snapshot_dir/current`` is a symlink switched atomically once a snapshot
is complete, so an engine never starts from a half-written one. Engines started from a snapshot
still count as pending until a sync verifies them at the trainer's current version.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from .plan import Span, TensorPlan, make_buckets


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
    """Every trainer rank (``source.gather`` is a collective); rank 0 writes. Returns the
    snapshot directory on rank 0."""
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    root = Path(snapshot_dir)
    final = root / f"v{version}"
    tmp = root / f".v{version}.partial"
    tensors = [TensorPlan(n, d, tuple(s), [Span(0, 0, 0)]) for n, d, s in source.metadata()]
    buckets = make_buckets(tensors, int(bucket_mb * 2**20))
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    weight_map = {}
    for i, bucket in enumerate(buckets):
        names = [t.name for t in bucket.tensors]
        full = source.gather(names)
        if rank == 0:
            fname = f"model-{i + 1:05d}-of-{len(buckets):05d}.safetensors"
            save_file({n: full[n].contiguous() for n in names}, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in names})
    if rank != 0:
        return None
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"dist_sr_weight_version": version}, "weight_map": weight_map}, indent=1)
    )
    if config is not None:
        config.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        dtypes = {d for _, d, _ in source.metadata()}
        if len(dtypes) == 1:  # serve in the dtype of the working weights (the trainer loads FP32 configs)
            cfg["dtype"] = cfg["torch_dtype"] = dtypes.pop()
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    link = root / ".current.tmp"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(final.name)
    os.replace(link, root / "current")  # atomic switch
    versions = sorted((int(p.name[1:]) for p in root.glob("v*") if p.name[1:].isdigit()), reverse=True)
    for old in versions[keep:]:
        shutil.rmtree(root / f"v{old}", ignore_errors=True)
    return final
