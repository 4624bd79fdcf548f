"""What the integrations' own plug points (verl's ``external_lib``, OpenRLHF's start-up, TRL's
``enable``) check before they turn SR on: that DeepSpeed, if this process imported it, was imported
through dist-sr's start-up hook. An unpatched ``deepspeed.initialize`` builds engines that round
to nearest, and where the hook did not run here it did not run in the job's other processes
started the same way either."""

from __future__ import annotations

import sys

from .. import startup_check as hook
from ..config import Refusal


class DeepSpeedUnpatched(Refusal, RuntimeError):
    what = "DeepSpeed imported without dist-sr's hook"


def require_deepspeed_hooked(asked_by: str) -> None:
    """Refuse when ``deepspeed`` is imported in this process and its ``initialize`` is not
    dist-sr's; ``asked_by`` names what asks for SR (the plug point)."""
    if "deepspeed" not in sys.modules or hook.active():
        return
    _, why = hook.diagnose()
    raise DeepSpeedUnpatched(
        f"{asked_by} asks for keyed SR, but deepspeed was imported in this process without dist-sr's start-up "
        f"hook: deepspeed.initialize is DeepSpeed's own, so a DeepSpeed engine built here would train "
        f"round-to-nearest. The hook: {why}. `dist-sr doctor` says the same for this environment"
    )
