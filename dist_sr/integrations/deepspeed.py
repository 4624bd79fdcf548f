"""Deprecated location of the DeepSpeed integration: it lives in ``dist_sr.engines.deepspeed``
(``hook``: ``initialize``/``attach``; ``config``: the JSON block and the precision switch;
``version``: the tested versions). These names keep working."""

import warnings

from ..engines.deepspeed.config import CONFIG_KEY, SRConfig, config_for_precision, precision_of_config, split_config
from ..engines.deepspeed.hook import DeepSpeedSR, attach, hooked_initialize, initialize
from ..engines.deepspeed.version import TESTED, UnsupportedDeepSpeed, check_version

warnings.warn(
    "dist_sr.integrations.deepspeed moved to dist_sr.engines.deepspeed (hook, config, version)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "CONFIG_KEY",
    "TESTED",
    "DeepSpeedSR",
    "SRConfig",
    "UnsupportedDeepSpeed",
    "attach",
    "check_version",
    "config_for_precision",
    "hooked_initialize",
    "initialize",
    "precision_of_config",
    "split_config",
]
