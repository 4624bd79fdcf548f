"""The bare receiver's HTTP server: the same routes as a vLLM engine in dev mode, backed by one
``WeightReceiver`` that only receives (and keeps) the tensors, no model. A real receiving process
for measuring the transport without vLLM's reload cost (bench/weight_sync.py), and the engine
the fleet tests run against; ``engine.cli`` starts it.

Every request but ``/health`` needs the job's sync secret (``weightsync.auth``: 401 otherwise);
bodies are capped at ``auth.MAX_BODY_BYTES`` and a client gets ``request_timeout_s`` to send one.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ...numerics.digest import tensor_sums
from .. import auth
from .receiver import InitInfo, WeightReceiver


class _Handler(BaseHTTPRequestHandler):
    receiver: WeightReceiver
    tensors: dict
    timeout = 30  # seconds a client may take to send a request (a socket timeout, per connection)

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes | None:
        """The request body, or None after replying 4xx (missing length, too large)."""
        try:
            size = int(self.headers.get("content-length", 0))
        except ValueError:
            self._reply(400, {"error": "malformed content-length"})
            return None
        if size < 0 or size > auth.MAX_BODY_BYTES:
            self.close_connection = True
            self._reply(413, {"error": f"control request body of {size} bytes; the limit is {auth.MAX_BODY_BYTES}"})
            return None
        return self.rfile.read(size)

    def _authentic(self, body: bytes) -> bool:
        try:
            self.receiver.verifier.request(self.command, self.path, body, self.headers)
            return True
        except auth.AuthError as exc:
            self._reply(401, {"error": str(exc)})
            return False

    def do_GET(self):
        if self.path.split("?")[0] == "/health":
            return self._reply(200, {})
        if not self._authentic(b""):
            return None
        if self.path.startswith("/get_world_size"):
            return self._reply(200, {"world_size": 1})
        return self._reply(404, {"error": self.path})

    def do_POST(self):
        raw = self._body()
        if raw is None or not self._authentic(raw):
            return None
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("expected a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            return self._reply(400, {"error": f"malformed JSON body: {exc}"})
        path = self.path.split("?")[0]
        r = self.receiver
        try:
            if path == "/init_weight_transfer_engine":
                r.init(InitInfo(**body["init_info"]))
            elif path == "/start_weight_update":
                r.start()
            elif path == "/update_weights":
                update = body["update_info"]
                r.receive(update["plan"], lambda ts: self.tensors.update(ts), update.get("auth"))
            elif path == "/finish_weight_update":
                r.finish()
            elif path == "/collective_rpc":
                if body.get("method") == "dist_sr_held_weights":
                    return self._reply(200, {"results": [held_answer(self.tensors)]})
                if body.get("method") != "dist_sr_weight_report":
                    return self._reply(400, {"error": f"unknown method {body.get('method')!r}"})
                return self._reply(200, {"results": [r.report()]})
            elif path not in ("/pause", "/resume", "/reset_prefix_cache"):
                return self._reply(404, {"error": path})
        except auth.AuthError as exc:
            return self._reply(401, {"error": str(exc)})
        except (KeyError, TypeError, ValueError) as exc:  # a request this receiver cannot act on
            return self._reply(400, {"error": f"bad request to {path}: {type(exc).__name__}: {exc}"})
        except Exception as exc:  # report to the trainer, as vLLM's routes do
            return self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
        return self._reply(200, {"status": "ok"})


def held_answer(tensors: dict) -> dict:
    """The bare receiver's ``dist_sr_held_weights``, as a vLLM worker's (``rollout.vllm.held``)
    answers it: the tensors it keeps, each read back whole."""
    sums = {n: (d, list(shape), f"{v:016x}") for n, (d, shape, v) in tensor_sums(tensors).items()}
    return {
        "method": "kept by the bare receiver",
        "digests": {n: list(entry) for n, entry in sums.items()},
        "readback": {n: [*entry, tensors[n].numel(), "whole"] for n, entry in sums.items()},
        "unreadable": {},
        "start": {"loader": "bare receiver", "load_format": None, "pushes": 1 if tensors else 0},
        "worker": {"rank": 0, "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_rank": 0},
    }


def serve(
    port: int,
    host: str = "127.0.0.1",
    *,
    receiver: WeightReceiver | None = None,
    secret: bytes | None = None,
    max_bytes: int | None = None,
    request_timeout_s: float = 30.0,
) -> ThreadingHTTPServer:
    """A bare receiver on ``host:port``, not serving yet (``serve_forever``): ``receiver``, or a
    ``WeightReceiver`` with ``secret`` and ``max_bytes``."""
    handler = type(
        "Handler",
        (_Handler,),
        {
            "receiver": receiver if receiver is not None else WeightReceiver(secret=secret, max_bytes=max_bytes),
            "tensors": {},
            "timeout": request_timeout_s,
        },
    )
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
