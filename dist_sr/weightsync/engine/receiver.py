"""The receiving half of the dist-sr weight transfer, shared by the vLLM backend and a bare
receiver server (``engine.server``, started by ``python -m dist_sr.weightsync.engine.cli``).

``WeightReceiver`` joins the groups of one generation, receives a plan's buckets (the next bucket
arriving while the current one loads), hands full HF-named tensors to a load function, and keeps
the report the trainer verifies. (The tests' faulty engine is a subclass of it,
``dist_sr.testing.faulty_receiver``.)

A plan with ``keep`` makes the receiver keep what it loads (the tensors handed to ``load``, a
host copy of the 16-bit weights: for a vLLM engine, host memory the size of its weights); a plan
with ``delta_base`` is applied to that copy, and refused unless the receiver holds exactly that
version from a complete sync (the trainer then sends a dense one).

Nothing changes weights without the job's sync secret (``weightsync.auth``): the receiver checks
the signatures of ``init_info`` and of every plan itself, and the bare server also every request
(401 otherwise). A bad init leaves the current groups in place; plans are checked against a byte
budget before anything is allocated; timeouts are bounded.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
from dataclasses import dataclass

import torch

from ...numerics import delta as delta_codec
from ...numerics import warm_up_kernels_in_background
from ...numerics.digest import DTYPES, tensor_sums
from .. import auth
from ..control import MAX_TIMEOUT_S, TIMEOUT_S
from ..plan import SyncPlan
from ..transport import BACKENDS, cuda_device, open_store, receive_buckets, transfer_group

log = logging.getLogger(__name__)


@dataclass
class InitInfo:
    master_address: str
    master_port: int
    rank_offset: int  # this engine's first worker in the group (1 + workers of earlier engines)
    world_size: int  # 1 + every worker of every engine
    senders: int = 1  # trainer ranks that send: 1 = gather-then-broadcast, M = shard-direct
    generation: int = 0  # bumped whenever the fleet is rebuilt
    timeout_s: float = TIMEOUT_S
    backend: str = "gloo"  # gloo (host memory), nccl (CUDA devices on both sides) or ipc (colocated)
    auth: dict | None = None  # the trainer's signature over the fields above (weightsync.auth)

    def fields(self) -> dict:
        """What the signature covers: every field but ``auth``, and ``backend`` only when it is not
        gloo (so an init from a trainer that names no backend verifies as before)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "auth"}
        if out["backend"] == "gloo":
            del out["backend"]
        return out

    def check(self) -> None:
        """Values a receiver can act on (raise ``ValueError`` naming the field otherwise)."""
        ints = {
            "master_port": (1, 65535),
            "rank_offset": (1, 2**20),
            "world_size": (2, 2**20),
            "senders": (1, 2**16),
            "generation": (0, 2**62),
        }
        for name, (lo, hi) in ints.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"init_info.{name}={v!r}: expected an integer in [{lo}, {hi}]")
        if not isinstance(self.master_address, str) or not 0 < len(self.master_address) <= 255:
            raise ValueError(f"init_info.master_address={self.master_address!r}: expected a host name or address")
        t = self.timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not (0 < t <= MAX_TIMEOUT_S):
            raise ValueError(f"init_info.timeout_s={t!r}: expected seconds in (0, {MAX_TIMEOUT_S:.0f}]")
        if self.backend not in BACKENDS:
            raise ValueError(f"init_info.backend={self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.rank_offset >= self.world_size:
            raise ValueError(f"init_info.rank_offset={self.rank_offset} is not below world_size={self.world_size}")


class WeightReceiver:
    """``secret``: the job's sync secret (default: this process's, ``auth.load``); ``max_bytes``:
    the most a plan may carry (an engine: about its model's size)."""

    def __init__(self, *, secret: bytes | None = None, max_bytes: int | None = None):
        self.verifier = auth.Verifier(secret if secret is not None else auth.load())
        self.max_bytes = max_bytes
        # digests of received (CPU) buckets take the C++ pass once it is loaded (built in the
        # background the first time in an environment; scripts/setup_vllm.sh builds it ahead)
        warm_up_kernels_in_background()
        self.groups: dict[int, object] = {}
        self.store = None
        self.rank: int | None = None
        self.received: dict[str, tuple[str, tuple[int, ...], int]] = {}
        self.state = {"version": None, "digests": {}, "complete": False}
        self.held: dict[str, torch.Tensor] = {}  # flat tensors of the last complete sync (plan.keep)
        self.held_version: int | None = None
        # Who the trainer verified: a restart gets a new boot id, and every accepted control event
        # counts, so the trainer can tell that an engine changed after it checked the digests.
        self.boot, self.events = secrets.token_hex(8), 0

    def init(self, info: InitInfo, worker_index: int = 0) -> None:
        """Join the groups ``info`` names, if the trainer signed it. The current groups stay until
        the new ones are up: a failed or refused init changes nothing."""
        self.verifier.payload("init_info", info.fields(), info.auth)
        info.check()
        rank = info.rank_offset + worker_index
        if rank >= info.world_size:
            raise ValueError(f"worker rank {rank} is outside the group's world of {info.world_size}")
        if info.backend == "nccl":
            cuda_device("this engine")  # refuse by name before joining anything
        store = open_store(info.master_address, info.master_port, is_master=False, timeout_s=info.timeout_s)
        prefix = auth.store_prefix(self.verifier.secret)
        groups = {
            m: transfer_group(
                store, info.generation, m, rank, info.world_size, info.timeout_s, prefix=prefix, backend=info.backend
            )
            for m in range(info.senders)
        }
        self.shutdown()
        self.rank, self.store, self.groups = rank, store, groups
        self.state = {"version": None, "digests": {}, "complete": False}
        self.events += 1

    def start(self) -> None:
        self.events += 1
        self.state["complete"] = False  # partially loaded weights from here to finish
        self.received = {}

    def check_plan(self, plan_json, signature) -> SyncPlan:
        """The plan, if the trainer signed it and it fits this receiver (before any allocation)."""
        self.verifier.payload("plan", plan_json, signature)
        try:
            plan = SyncPlan.from_json(plan_json)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed sync plan: {exc!r}") from None
        total = 0
        for b in plan.buckets:
            for t in b.tensors:
                if t.dtype not in DTYPES or not all(isinstance(d, int) and d >= 0 for d in t.shape):
                    raise ValueError(
                        f"sync plan: {t.name} has dtype {t.dtype!r} and shape {t.shape}; expected one of "
                        f"{sorted(DTYPES)} and non-negative integer sizes"
                    )
                total += math.prod(t.shape) * t.itemsize
        if self.max_bytes is not None and total > self.max_bytes:
            raise ValueError(
                f"sync plan carries {total} bytes, over this engine's limit of {self.max_bytes} "
                "(its model's size): wrong model, or not a plan for this engine"
            )
        plan.check()
        return plan

    def receive(self, plan_json: dict, load, signature: dict | None = None) -> None:
        plan = self.check_plan(plan_json, signature)
        if not self.groups:
            raise RuntimeError("dist-sr weight transfer is not initialised: call init_weight_transfer_engine first")
        if plan.senders != len(self.groups):
            raise RuntimeError(f"sync plan has {plan.senders} sender(s) but this engine joined {len(self.groups)}")
        base = plan.delta_base
        if base is not None and (base != self.held_version or not self.held):
            raise RuntimeError(
                f"a delta against weight version {base}, but this engine holds "
                f"{self.held_version if self.held else 'no kept version'}: it needs a dense sync"
            )
        self.events += 1
        self.state["complete"] = False
        self.held_version = None  # changing from here on
        if base is None:
            self.held = {}  # a dense sync replaces whatever was kept
            buckets = receive_buckets(self.groups, plan.buckets)  # bucket i+1 arrives while i loads
        else:
            buckets = zip(plan.buckets, receive_buckets(self.groups, plan.buckets, sized=True))
        refused = None
        for tensors in buckets:
            if base is not None:
                try:
                    tensors = self._apply(*tensors)
                except delta_codec.DeltaError as exc:  # receive the rest (the trainer is sending it), load nothing
                    refused = refused or f"{exc}"
                if refused:
                    continue
            tensors = self.loaded(tensors)
            if plan.keep and base is None:
                self.held.update((n, t.reshape(-1)) for n, t in tensors)
            if plan.digest:
                self.received.update(tensor_sums(dict(tensors)))
            load(tensors)
        if refused:
            self.held = {}
            raise RuntimeError(
                f"the delta against weight version {base} could not be applied ({refused}); "
                "this engine needs a dense sync"
            )
        self.state["version"] = plan.version
        if plan.keep:
            self.held_version = plan.version

    def loaded(self, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """A bucket's tensors just before they are kept, digested and loaded (as they arrived)."""
        return tensors

    def delta_received(self, name: str, buf: torch.Tensor, at: int) -> None:
        """A delta for ``name`` in ``buf`` (uint8) whose payload starts at ``at``, before it is read."""

    def _apply(self, bucket, buffers) -> list[tuple[str, torch.Tensor]]:
        """A delta bucket applied to the kept tensors; the updated tensors, full shape."""
        buffers = {src: b.cpu() for src, b in buffers.items()}  # the kept copy is in host memory
        cursor = dict.fromkeys(buffers, 0)
        out = []
        for t in bucket.tensors:
            held = self.held.get(t.name)
            if held is None or held.numel() != t.numel or held.dtype != DTYPES[t.dtype]:
                raise RuntimeError(
                    f"a delta for {t.name} ({t.dtype}, {t.numel} elements) does not match the kept "
                    f"copy ({None if held is None else (held.dtype, held.numel())})"
                )
            for p in t.spans:
                buf = buffers[p.src]
                self.delta_received(t.name, buf, cursor[p.src] + delta_codec.HEADER_BYTES)
                d, cursor[p.src] = delta_codec.read_delta(buf, cursor[p.src])
                delta_codec.apply_(held[p.start : p.end], d)
            out.append((t.name, held.view(t.shape)))
        return out

    def finish(self) -> None:
        self.events += 1
        self.state = {"version": self.state["version"], "digests": dict(self.received), "complete": True}

    def report(self) -> dict:
        s = self.state
        return {
            "version": s["version"],
            "complete": s["complete"],
            "rank": self.rank,
            "boot": self.boot,
            "events": self.events,
            "held": self.held_version,
            "digests": {n: [d, list(shape), f"{v:016x}"] for n, (d, shape, v) in s["digests"].items()},
        }

    def shutdown(self) -> None:
        for g in self.groups.values():
            try:
                g.shutdown()
            except Exception:  # a group whose peers are gone cannot shut down cleanly
                pass
        self.groups, self.store = {}, None
