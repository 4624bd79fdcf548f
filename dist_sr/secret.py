"""Shared secrets from the environment: a value (``NAME``) or a file holding it (``NAME_FILE``,
e.g. a mounted Kubernetes Secret). The weight-sync secret (``weightsync.auth``) and the key of
checkpoint manifests (``engines.checkpoints``) are read this way."""

from __future__ import annotations

import os
from typing import Mapping

from .config import Refusal

MIN_BYTES = 16  # shortest secret accepted


class SecretMissing(Refusal, RuntimeError):
    """This process has no secret but needs one (or cannot read the one it was pointed at)."""

    what = "secret"


def read(name: str, *, what: str, env: Mapping[str, str] | None = None) -> tuple[bytes, str] | None:
    """The secret from ``name`` or ``name + "_FILE"`` (stripped), with where it came from; None
    if neither is set. ``what`` names the secret in errors."""
    env = os.environ if env is None else env
    value, origin = env.get(name), name
    if not value and env.get(name + "_FILE"):
        origin = f"{name}_FILE={env[name + '_FILE']}"
        try:
            with open(env[name + "_FILE"], "rb") as f:
                value = f.read().decode().strip()
        except OSError as exc:
            raise SecretMissing(f"cannot read the {what} from {origin}: {exc}") from None
    if not value:
        return None
    if len(value.encode()) < MIN_BYTES:
        raise SecretMissing(
            f"the {what} from {origin} has {len(value.encode())} bytes; use at least {MIN_BYTES} "
            "(e.g. secrets.token_hex(32))"
        )
    return value.encode(), origin
