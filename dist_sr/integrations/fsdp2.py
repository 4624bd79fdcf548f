"""Deprecated location of the FSDP2 integration: it lives in ``dist_sr.engines.fsdp2`` (``hook``:
``prepare``/``SRShadowParam``; ``engine``: ``apply_fsdp2``; ``config``; ``source``) and
``dist_sr.numerics.shards`` (``local_shard``, ``replica_slot``, ``shard_layout``). These names
keep working."""

import warnings

from ..engines.fsdp2.config import FSDP2Config
from ..engines.fsdp2.engine import apply_fsdp2, pure_bf16_optimizer
from ..engines.fsdp2.hook import (
    MIXED_PRECISION,
    SRContext,
    SRShadowParam,
    full_master,
    plain,
    prepare,
    sharded_state_dict,
)
from ..numerics.shards import local_shard, replica_slot, shard_layout

warnings.warn(
    "dist_sr.integrations.fsdp2 moved to dist_sr.engines.fsdp2 (hook, engine, config, source)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "MIXED_PRECISION",
    "FSDP2Config",
    "SRContext",
    "SRShadowParam",
    "apply_fsdp2",
    "full_master",
    "local_shard",
    "plain",
    "prepare",
    "pure_bf16_optimizer",
    "replica_slot",
    "shard_layout",
    "sharded_state_dict",
]
