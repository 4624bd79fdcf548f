"""The bare receiver's command: ``python -m dist_sr.weightsync.engine.cli --port P`` serves
``engine.server`` on loopback (``--host`` to change). It needs the job's sync secret and exits
naming where to put it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from .. import auth
from .receiver import WeightReceiver
from .server import serve


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="A bare dist-sr weight receiver (vLLM's weight routes, no model). "
        f"Needs the job's sync secret in {auth.ENV} or {auth.ENV_FILE}."
    )
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--max-mb", type=float, default=4096.0, help="largest plan accepted (MiB)")
    ap.add_argument("--request-timeout", type=float, default=30.0, help="seconds a client may take to send a request")
    return ap


def run(args: argparse.Namespace, receiver: Callable[..., WeightReceiver] = WeightReceiver) -> None:
    """Serve ``receiver(max_bytes=...)`` until killed."""
    try:
        server = serve(
            args.port,
            args.host,
            receiver=receiver(max_bytes=int(args.max_mb * 2**20)),
            request_timeout_s=args.request_timeout,
        )
    except auth.SecretMissing as exc:
        sys.exit(f"dist-sr receiver: {exc}")
    server.serve_forever()


def main() -> None:
    run(parser().parse_args())


if __name__ == "__main__":
    main()
