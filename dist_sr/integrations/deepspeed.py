"""Deprecated location of the DeepSpeed integration: it lives in ``dist_sr.engines.deepspeed``
(``hook``: ``initialize``/``attach``; ``config``: the JSON block and the precision switch;
``version``: the tested versions). These names keep working."""

import warnings

from ..engines import deepspeed as _moved
from ..engines.deepspeed import *  # noqa: F403  (every public name of the new location)

warnings.warn(
    "dist_sr.integrations.deepspeed moved to dist_sr.engines.deepspeed (hook, config, version)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = list(_moved.__all__)
