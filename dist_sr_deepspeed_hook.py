"""The name ``dist_sr_deepspeed_hook.pth`` imports at start-up (and Ray's
``worker_process_setup_hook`` may name): the start-up hook is ``dist_sr.integrations.startup``."""

from dist_sr.integrations.startup import register  # noqa: F401
