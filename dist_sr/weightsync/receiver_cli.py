"""The bare receiver's command: ``python -m dist_sr.weightsync.receiver_cli --port P`` serves
``receiver_server`` on loopback (``--host`` to change); ``--corrupt NAME`` makes it a faulty
engine (``receiver_faults``). It needs the job's sync secret and exits naming where to put it.
"""

from __future__ import annotations

import argparse
import sys

from . import auth
from .receiver_server import serve


def main() -> None:
    ap = argparse.ArgumentParser(
        description="A bare dist-sr weight receiver (vLLM's weight routes, no model). "
        f"Needs the job's sync secret in {auth.ENV} or {auth.ENV_FILE}."
    )
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--max-mb", type=float, default=4096.0, help="largest plan accepted (MiB)")
    ap.add_argument("--request-timeout", type=float, default=30.0, help="seconds a client may take to send a request")
    ap.add_argument(
        "--corrupt",
        metavar="NAME",
        help="fault injection (tests): flip one bit of tensor NAME as it "
        "is loaded, so this receiver holds and reports wrong bits; delta:NAME flips one bit of the "
        "first delta received for NAME",
    )
    args = ap.parse_args()
    try:
        server = serve(
            args.port,
            args.host,
            args.corrupt,
            max_bytes=int(args.max_mb * 2**20),
            request_timeout_s=args.request_timeout,
        )
    except auth.SecretMissing as exc:
        sys.exit(f"dist-sr receiver: {exc}")
    server.serve_forever()


if __name__ == "__main__":
    main()
