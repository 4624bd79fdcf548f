"""FSDP2: SR in the all-gather cast (``hook``), sharding by the precision switch (``apply``), the
config section (``config``), the shards as a weight source (``source``) and the training engine
(``engine``, registered by ``dist_sr.engines``)."""

from .apply import apply_fsdp2, pure_bf16_optimizer
from .config import FSDP2Config
from .hook import MIXED_PRECISION, SRContext, SRShadowParam, full_master, plain, prepare, sharded_state_dict
from .source import FSDP2Source

__all__ = [
    "MIXED_PRECISION",
    "FSDP2Config",
    "FSDP2Source",
    "SRContext",
    "SRShadowParam",
    "apply_fsdp2",
    "full_master",
    "plain",
    "prepare",
    "pure_bf16_optimizer",
    "sharded_state_dict",
]
