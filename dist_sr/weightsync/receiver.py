"""The receiving half of the dist-sr weight transfer, shared by the vLLM backend and a bare
receiver server.

``WeightReceiver`` joins the groups of one generation, receives a plan's buckets (the next bucket
arriving while the current one loads), hands full HF-named tensors to a load function, and keeps
the report the trainer verifies. ``python -m dist_sr.weightsync.receiver --port P`` serves the same
HTTP routes as a vLLM engine in dev mode but only receives (and keeps) the tensors: a real
receiving process for measuring the transport without vLLM's reload cost (bench/weight_sync.py).
``--corrupt NAME`` makes it a faulty engine: it flips one bit of tensor ``NAME`` as it loads it
(and reports the bits it holds), so the trainer's digest check can be exercised without vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from ..numerics.backends import cpu
from ..numerics.digest import tensor_sums
from .control import TIMEOUT_S
from .plan import SyncPlan
from .transport import gloo_group, open_store, receive_buckets

log = logging.getLogger(__name__)


@dataclass
class InitInfo:
    master_address: str
    master_port: int
    rank_offset: int       # this engine's first worker in the group (1 + workers of earlier engines)
    world_size: int        # 1 + every worker of every engine
    senders: int = 1       # trainer ranks that send: 1 = gather-then-broadcast, M = shard-direct
    generation: int = 0    # bumped whenever the fleet is rebuilt
    timeout_s: float = TIMEOUT_S


class WeightReceiver:
    def __init__(self, corrupt: str | None = None):
        # digests of received (CPU) buckets take the C++ pass once it is loaded (built in the
        # background the first time in an environment; scripts/setup_vllm.sh builds it ahead)
        cpu.warm_up_in_background()
        self.groups: dict[int, object] = {}
        self.store = None
        self.rank: int | None = None
        self.received: dict[str, tuple[str, tuple[int, ...], int]] = {}
        self.state = {"version": None, "digests": {}, "complete": False}
        self.corrupt = corrupt  # fault injection: the tensor whose first element gets one bit flipped

    def init(self, info: InitInfo, worker_index: int = 0) -> None:
        self.shutdown()
        self.rank = info.rank_offset + worker_index
        self.store = open_store(info.master_address, info.master_port, is_master=False, timeout_s=info.timeout_s)
        self.groups = {m: gloo_group(self.store, info.generation, m, self.rank, info.world_size, info.timeout_s)
                       for m in range(info.senders)}
        self.state = {"version": None, "digests": {}, "complete": False}

    def start(self) -> None:
        self.state["complete"] = False  # partially loaded weights from here to finish
        self.received = {}

    def receive(self, plan_json: dict, load) -> None:
        if not self.groups:
            raise RuntimeError("dist-sr weight transfer is not initialised: call init_weight_transfer_engine first")
        plan = SyncPlan.from_json(plan_json)
        plan.check()
        if plan.senders != len(self.groups):
            raise RuntimeError(f"sync plan has {plan.senders} sender(s) but this engine joined {len(self.groups)}")
        for tensors in receive_buckets(self.groups, plan.buckets):  # bucket i+1 arrives while i loads
            if self.corrupt is not None:
                tensors = [(n, _flip_one_bit(t) if n == self.corrupt else t) for n, t in tensors]
            if plan.digest:
                self.received.update(tensor_sums(dict(tensors)))
            load(tensors)
        self.state["version"] = plan.version

    def finish(self) -> None:
        self.state = {"version": self.state["version"], "digests": dict(self.received), "complete": True}

    def report(self) -> dict:
        s = self.state
        return {"version": s["version"], "complete": s["complete"], "rank": self.rank,
                "digests": {n: [d, list(shape), f"{v:016x}"] for n, (d, shape, v) in s["digests"].items()}}

    def shutdown(self) -> None:
        for g in self.groups.values():
            try:
                g.shutdown()
            except Exception:  # a group whose peers are gone cannot shut down cleanly
                pass
        self.groups, self.store = {}, None


def _flip_one_bit(t):
    t = t.clone()
    t.reshape(-1)[:1].view(torch.uint8)[0] ^= 1
    return t


class _Handler(BaseHTTPRequestHandler):
    receiver: WeightReceiver
    tensors: dict

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/health"):
            return self._reply(200, {})
        if self.path.startswith("/get_world_size"):
            return self._reply(200, {"world_size": 1})
        return self._reply(404, {"error": self.path})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        path = self.path.split("?")[0]
        r = self.receiver
        try:
            if path == "/init_weight_transfer_engine":
                r.init(InitInfo(**body["init_info"]))
            elif path == "/start_weight_update":
                r.start()
            elif path == "/update_weights":
                r.receive(body["update_info"]["plan"], lambda ts: self.tensors.update(ts))
            elif path == "/finish_weight_update":
                r.finish()
            elif path == "/collective_rpc":
                if body.get("method") != "dist_sr_weight_report":
                    return self._reply(400, {"error": f"unknown method {body.get('method')!r}"})
                return self._reply(200, {"results": [r.report()]})
            elif path not in ("/pause", "/resume", "/reset_prefix_cache"):
                return self._reply(404, {"error": path})
        except Exception as exc:  # report to the trainer, as vLLM's routes do
            return self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
        return self._reply(200, {"status": "ok"})


def serve(port: int, host: str = "127.0.0.1", corrupt: str | None = None) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"receiver": WeightReceiver(corrupt), "tensors": {}})
    return ThreadingHTTPServer((host, port), handler)


def main() -> None:
    ap = argparse.ArgumentParser(description="A bare dist-sr weight receiver (vLLM's weight routes, no model).")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--corrupt", metavar="NAME", help="fault injection (tests): flip one bit of tensor NAME as it "
                    "is loaded, so this receiver holds and reports wrong bits")
    args = ap.parse_args()
    serve(args.port, args.host, args.corrupt).serve_forever()


if __name__ == "__main__":
    main()
