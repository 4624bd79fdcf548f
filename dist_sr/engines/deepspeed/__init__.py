"""DeepSpeed ZeRO 0-3: keyed SR at DeepSpeed's copy sites and ``initialize`` (``hook``), where
each optimizer keeps its masters and partitions, offloaded or not (``layouts``), AutoTP shards in
their full parameters (``tp``), the JSON config and the precision switch (``config``), the tested
versions (``version``), ZeRO-3 partitions as a weight source (``source``) and the training engine
(``engine``, registered by ``dist_sr.engines``)."""

from .config import CONFIG_KEY, SRConfig, config_for_precision, precision_of_config, split_config
from .hook import DeepSpeedSR, attach, hooked_initialize, initialize
from .source import ZeRO3Source
from .version import TESTED, UnsupportedDeepSpeed, check_version

__all__ = [
    "CONFIG_KEY",
    "TESTED",
    "DeepSpeedSR",
    "SRConfig",
    "UnsupportedDeepSpeed",
    "ZeRO3Source",
    "attach",
    "check_version",
    "config_for_precision",
    "hooked_initialize",
    "initialize",
    "precision_of_config",
    "split_config",
]
