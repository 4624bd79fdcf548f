"""How to shard a model with FSDP2 (the ``distributed.fsdp2`` config section)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ...config import from_dict as load_section


@dataclass
class FSDP2Config:
    """How to shard a model with FSDP2 under the precision switch (see configs/fsdp2-sr.yaml)."""

    shard_modules: list[str] = field(default_factory=lambda: ["Qwen2DecoderLayer", "LlamaDecoderLayer"])
    reshard_after_forward: bool = True
    # HSDP: shard within groups of world/replicate ranks (e.g. a node), replicate across the groups
    replicate: int = 1
    # FSDP2's CPUOffloadPolicy: sharded masters (and optimizer states) on the host; with SR the
    # shards are rounded there and their BF16 bits copied to the device for each all-gather
    cpu_offload: bool = False
    # keep each shard's BF16 rounding between the all-gathers of a step (2 bytes per local
    # parameter; without it every all-gather, the backward re-gather included, rounds again)
    keep_rounded: bool = True

    def __post_init__(self):
        if not isinstance(self.replicate, int) or isinstance(self.replicate, bool) or self.replicate < 1:
            raise ValueError(f"fsdp2.replicate must be a positive int, got {self.replicate!r}")

    @classmethod
    def from_dict(cls, data: "dict | FSDP2Config | None") -> "FSDP2Config":
        return data if isinstance(data, cls) else load_section(cls, dict(data or {}), "fsdp2")

    def check_world(self, world: int) -> None:
        """HSDP needs world = replicate x shard-group size."""
        if world % self.replicate:
            raise ValueError(
                f"fsdp2.replicate={self.replicate} does not divide the world size {world}: HSDP "
                "needs world = replicate x shard-group size"
            )

    def mesh(self):
        """The device mesh: None (FSDP2's default, shard over the world) or, with ``replicate`` > 1,
        a ``(replicate, shard)`` mesh for HSDP. Needs the process group."""
        if self.replicate == 1:
            return None
        world = dist.get_world_size()
        self.check_world(world)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return init_device_mesh(
            device, (self.replicate, world // self.replicate), mesh_dim_names=("replicate", "shard")
        )
