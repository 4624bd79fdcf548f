"""vLLM's own dense weight-transfer engine (``nccl``) driven from a dist-sr trainer through vLLM's
trainer-side API: the keyed bits as its ``WeightSource``, every control request signed, and after
each send the engines' held weights checked against what was sent.

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    source = KeyedWeightSource(model_or_deepspeed_engine)      # on every trainer rank
    client = SignedClient(url)                                 # signs with DIST_SR_SYNC_SECRET
    engine = WeightTransferTrainerFactory.trainer_init(
        NCCLTrainerInitInfo(master_address, port, world_size, rank=rank), client=client, source=source)
    send_verified(engine, source, [client])                    # every rank; raises on a mismatch

    # several engines: one client driving them all, each engine's NCCL ranks after the last's
    fan = FanOutClient([SignedClient(u) for u in urls])     # world_size = 1 + sum(fan.workers())
    send_verified(engine, source, fan.clients)

- ``KeyedWeightSource`` is a ``vllm.distributed.weight_transfer.base.WeightSource`` over
  ``rollout_weights``: the BF16 working weights the trainer's forward pass uses (the keyed SR
  bits where the precision rounds), full size, from a plain module, FSDP2 or DeepSpeed; its
  ``metadata()`` reads shapes without gathering. While it streams it sums the layout-free digest
  of every tensor it yields, so the sender knows what went out without a second pass (the pass
  counts as sent once its last tensor is yielded, however the engine drives it: ``for``,
  ``iter_groups``).
- ``SignedClient`` is vLLM's ``VLLMWeightSyncClient`` protocol over HTTP with every request
  signed with the job's sync secret, for engines that run dist-sr's middleware
  (``--middleware dist_sr.rollout.vllm.auth.SyncAuthMiddleware``), which refuses unsigned calls to
  the weight routes. It refuses vLLM's ``ipc`` engine at its init, before any update opens: vLLM
  takes CUDA IPC handles only as pickles over HTTP (``VLLM_ALLOW_INSECURE_SERIALIZATION``);
  colocated engines take dist-sr's own ``ipc`` backend instead (``rollout.vllm.backend: ipc``),
  which passes JSON handles only.
- ``FanOutClient`` drives several engines with one trainer engine (vLLM's HTTP client drives
  one): each call concurrently to all, the NCCL ``rank_offset`` shifted per engine. An engine
  that fails a call or answers with anything but an answer (``control.http``: a broken status
  line, a body cut short or not UTF-8, the wrong JSON) is named and marked down (``down``), and
  the next trainer engine's world (``workers()``) goes on with the others.
- ``send_verified`` sends, then asks every engine's workers for the digest of the weights they
  hold (``dist_sr_held_weights``, recorded in the model's ``load_weights``, where vLLM's dense
  ``nccl`` receiver, packed or not, ends) and compares each tensor sent with it: an engine that
  holds anything else is an ``EngineError`` naming it and the first tensors that differ.

Not for vLLM's ``nccl_m2n``, ``sharded_rdt`` or ``sparse_nccl``: the first takes only its own
sharded ``M2NWeightSource``, and all three write the engine's parameters in place, past
``load_weights``, so the held-weights record would not see their result (dist-sr's own fleet sync
has shard-direct and delta modes that it does verify).

Without vLLM installed ``KeyedWeightSource`` refuses to be built, saying so; the rest works.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterator

from ...numerics.digest import combine, dtype_name, piece_sum
from ...weightsync import auth
from ...weightsync.control import EngineError, MalformedReply
from ...weightsync.trainer.export import rollout_metadata, rollout_weights
from .check import answered_by_every_worker
from .control import http, worker_count

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 300.0  # as vLLM's own HTTP client: init waits for the rendezvous, an update for the send


try:  # vLLM's trainer-side API; without vLLM the source refuses to be built, the rest works
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    _MISSING = None
except ImportError as exc:  # pragma: no cover - exercised in the training environment
    WeightSource, ParamMeta, _MISSING = object, None, str(exc)

Entries = dict[str, tuple[str, tuple[int, ...], int]]  # digest entries: {name: (dtype, shape, sum)}


class KeyedWeightSource(WeightSource):  # type: ignore[misc, valid-type]
    """vLLM ``WeightSource`` over the keyed working weights of ``obj`` (a module, an FSDP2 module or
    a DeepSpeed engine). Iterating is a collective under ZeRO-3 and FSDP2: every trainer rank
    iterates, in the same order, as vLLM's trainer engines do."""

    def __init__(self, obj: Any):
        if _MISSING is not None:
            raise RuntimeError(
                "KeyedWeightSource feeds vLLM's trainer-side weight transfer, which needs vLLM with "
                f"vllm.distributed.weight_transfer.base ({_MISSING}); install vLLM in the trainer's "
                "environment, or use dist-sr's own fleet sync (rollout.engine: vllm)"
            )
        self.obj = obj
        self._meta = rollout_metadata(obj)
        self.sent: Entries = {}  # digest entries of the last complete pass

    def metadata(self) -> list:
        import torch

        return [ParamMeta(m.name, getattr(torch, m.dtype), tuple(m.shape)) for m in self._meta]

    def __iter__(self) -> Iterator:
        sums: Entries = {}
        last = len(self._meta) - 1
        metas = iter(self._meta)
        for i, (name, tensor) in enumerate(rollout_weights(self.obj)):
            meta = next(metas, None)
            got = (name, dtype_name(tensor.dtype), tuple(tensor.shape))
            if meta is None or got != tuple(meta):
                raise RuntimeError(
                    f"the trainer's weights changed between metadata() and the send: got {got}, metadata "
                    f"said {None if meta is None else tuple(meta)}; build the source after the model is "
                    "wrapped (fully_shard, deepspeed.initialize)"
                )
            sums[name] = (got[1], got[2], piece_sum(tensor.detach().contiguous(), 0))
            if i == last:  # the pass is complete: engines that stop pulling here (iter_groups) sent it all
                self.sent = sums
            yield name, tensor
        missing = [m.name for m in metas]
        if missing:
            raise RuntimeError(f"the trainer's weights lack {missing[:3]}, which metadata() announced")

    def digest(self) -> str:
        """The layout-free digest of the last complete pass (what was sent)."""
        if not self.sent:
            raise RuntimeError("nothing sent yet: iterate the source (send_weights) first")
        return combine(self.sent)


class SignedClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol (the five weight routes) for one ``vllm serve``
    engine, every request signed with the sync secret (default: this process's)."""

    def __init__(self, url: str, secret: bytes | None = None, timeout_s: float = HTTP_TIMEOUT_S):
        self.url = url.rstrip("/")
        self.secret = secret if secret is not None else auth.load()
        self.timeout_s = timeout_s

    def _post(self, route: str, body: dict | None = None) -> dict:
        return http(self.url, "/" + route, body if body is not None else {}, timeout=self.timeout_s, secret=self.secret)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if set(init_info) == {"packed"}:  # vLLM's ipc engine: no rendezvous, handles pickled per update
            raise EngineError(self._ipc_refusal("this is vLLM's ipc engine"))
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def _ipc_refusal(self, what: str) -> str:
        return (
            f"{self.url}: {what}, whose CUDA IPC handles vLLM takes only as pickles over HTTP "
            "(VLLM_ALLOW_INSECURE_SERIALIZATION); for colocated engines use dist-sr's own ipc backend "
            "(rollout.vllm.backend: ipc), whose handles are JSON and whose payloads are signed"
        )

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, update_info) -> None:
        infos = update_info if isinstance(update_info, list) else [update_info]
        if any(isinstance(i, dict) and (i.get("ipc_handles") or i.get("ipc_handles_pickled")) for i in infos):
            raise EngineError(self._ipc_refusal("this update carries CUDA IPC handles"))
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {} if weight_version is None else {"weight_version": weight_version})

    def world_size(self) -> int:
        """The engine's worker count (vLLM's ``/get_world_size``)."""
        return worker_count(self.url, http(self.url, "/get_world_size", timeout=self.timeout_s, secret=self.secret))

    def held_weights(self) -> list[dict]:
        """Every worker's ``dist_sr_held_weights``: ``{"method", "digests"}`` each."""
        results = self._post("collective_rpc", {"method": "dist_sr_held_weights"}).get("results")
        if not isinstance(results, list) or not all(isinstance(r, dict) and "digests" in r for r in results):
            raise MalformedReply(
                f"{self.url}/collective_rpc: the workers' held-weights records are {results!r:.300}, not records "
                "(is the worker extension dist_sr.rollout.vllm.plugin.WorkerExtension?)"
            )
        return results


class FanOutClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol for several ``vllm serve`` engines driven as one:
    every call goes to all of them at once (an NCCL engine's init and update block inside
    collectives every engine joins, so one at a time would never return), and an NCCL init
    info's ``rank_offset`` is shifted for each engine past the workers of the engines before it.
    ``world_size`` in the trainer's init info counts the trainer's sender ranks (vLLM puts them
    first) and every engine's workers; a mismatch is refused before any engine is called.

    An engine that fails a call, or answers with something that is not an answer, is marked down
    (``down``: its URL and the reason) and left out of ``clients`` from then on: errors of every
    engine are raised together, each naming its engine, and the next trainer engine's world
    (``1 + sum(workers())``) counts only the others, so the send goes on without it. ``rejoin()``
    asks every engine again (after a restart). ``workers()`` raises only when no engine answers.

    Never silently partial: an init whose ``world_size`` counts a down engine is refused naming it
    and why; the update calls go to the engines the last init reached (``members``), and while one
    of those is down each is refused before any engine is called, naming it (its ranks are in the
    trainer's transfer world: init a new world without it, or restart it and ``rejoin()``). A call
    that goes on without engines an init left out logs their names and reasons."""

    def __init__(self, clients: list[SignedClient]):
        if not clients:
            raise ValueError("FanOutClient needs at least one engine's SignedClient")
        self.engines = list(clients)  # every engine, in rank order
        self.down: dict[str, str] = {}  # url -> why it is left out
        self.members: list[str] | None = None  # the engines the last init reached: the trainer's transfer world
        self._workers: list[int] | None = None

    @property
    def clients(self) -> list[SignedClient]:
        """The engines that are not down, in rank order: those the next init and send reach."""
        return [c for c in self.engines if c.url not in self.down]

    def workers(self) -> list[int]:
        """Each live engine's worker count (its NCCL ranks), in the order of ``clients``, asked
        once per world: an engine that fails to answer is marked down, named."""
        if self._workers is None:
            counts: dict[str, int] = {}
            live = self.clients
            self._run(live, lambda c, _: counts.__setitem__(c.url, c.world_size()), [None] * len(live))
            if not counts:
                raise EngineError("no engine answers: " + "; ".join(f"{u}: {r}" for u, r in self.down.items()))
            self._workers = [counts[c.url] for c in self.clients]
        return self._workers

    def rejoin(self) -> None:
        """Take every engine back (after restarts): the next ``workers()`` asks them all again."""
        self.down, self._workers = {}, None

    def _run(self, clients: list[SignedClient], call, args: list) -> list[str]:
        """``call(client, arg)`` on every client at once; those that fail are marked down; returns
        the failures, each starting with its engine's URL."""
        errors: dict[str, str] = {}

        def run(client, arg):
            try:
                call(client, arg)
            except EngineError as exc:
                errors[client.url] = str(exc)
            except Exception as exc:  # noqa: BLE001  (named with its engine, raised by the caller)
                errors[client.url] = f"{client.url}: {type(exc).__name__}: {exc}"

        threads = [threading.Thread(target=run, args=(c, a), daemon=True) for c, a in zip(clients, args)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for url, why in errors.items():
            log.warning("engine %s is down: %s", url, why)
            self.down[url] = why
        return sorted(errors.values())

    def _call(self, clients: list[SignedClient], call, args: list) -> None:
        errors = self._run(clients, call, args)
        if errors:
            self._workers = None  # the next trainer engine's world is asked again
            raise EngineError("; ".join(errors))

    def _why_down(self, urls) -> str:
        return "; ".join(self.down[u] if self.down[u].startswith(u) else f"{u}: {self.down[u]}" for u in urls)

    def _each(self, route: str, call, arg=None, *, refuse_down: bool = True) -> None:
        """``call(client, arg)`` on every engine of the trainer's transfer world; refused before
        any engine is called while one of them is down (``refuse_down``), naming it."""
        world = self.members if self.members is not None else [c.url for c in self.engines]
        down = [u for u in world if u in self.down]
        if down and refuse_down:
            raise EngineError(
                f"{route} not sent: {len(down)} of the {len(world)} engines in the trainer's transfer world are down "
                f"({self._why_down(down)}); init the trainer's engine anew without them (world_size = its sender "
                "ranks + sum(workers())), or restart them and call rejoin() before that init"
            )
        targets = [c for c in self.clients if c.url in world]
        if len(targets) < len(self.engines):
            left = [c.url for c in self.engines if c not in targets]
            log.warning(
                "%s goes to %d of %d engines; not to %s",
                route,
                len(targets),
                len(self.engines),
                "; ".join(f"{u} ({self.down[u]})" if u in self.down else f"{u} (not in the last init)" for u in left),
            )
        self._call(targets, call, [arg] * len(targets))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.members = None  # the world the trainer had is gone: this init makes the next one
        sizes = self.workers()  # also leaves out the engines that do not answer
        live = self.clients
        infos = [init_info] * len(live)
        down = f"; left out, down: {self._why_down(self.down)}" if self.down else ""
        if "rank_offset" in init_info:  # NCCL: each engine's workers take the ranks after the last's
            first = int(init_info["rank_offset"])
            expected = first + sum(sizes)
            if init_info.get("world_size") != expected:
                raise EngineError(
                    f"init_info world_size={init_info.get('world_size')!r}, but the trainer's {first} sender "
                    f"rank(s) and the workers of the {len(sizes)} engine(s) that answer "
                    f"({' + '.join(map(str, sizes))}) make {expected}{down}: pass world_size={expected} in the "
                    "trainer's init info"
                    + (" to go on without them, or restart them and call rejoin()" if down else "")
                )
            infos = [dict(init_info, rank_offset=first + sum(sizes[:k])) for k in range(len(sizes))]
        if down:
            log.warning("init_weight_transfer_engine goes on without the engines that are down%s", down)
        self._call(live, lambda c, info: c.init_weight_transfer_engine(info), infos)
        self.members = [c.url for c in live]

    def shutdown_weight_transfer_engine(self) -> None:
        try:  # what is up is shut down, what is down is named (in the log): a shutdown is often cleanup
            self._each(
                "shutdown_weight_transfer_engine", lambda c, _: c.shutdown_weight_transfer_engine(), refuse_down=False
            )
        finally:
            self.members = None

    def start_weight_update(self) -> None:
        self._each("start_weight_update", lambda c, _: c.start_weight_update())

    def update_weights(self, update_info) -> None:
        self._each("update_weights", lambda c, info: c.update_weights(info), update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each("finish_weight_update", lambda c, v: c.finish_weight_update(v), weight_version)


def held_digest_entries(held: dict) -> Entries:
    """Digest entries of one worker's ``dist_sr_held_weights`` answer."""
    return digest_entries(held["digests"])


def digest_entries(recorded: dict) -> Entries:
    """Digest entries from a held-weights record's ``{name: [dtype, shape, hex sum]}``."""
    return {n: (d, tuple(shape), int(v, 16)) for n, (d, shape, v) in recorded.items()}


def check_held(name: str, workers: list[dict], sent: Entries) -> None:
    """Raise ``EngineError`` unless every worker of engine ``name`` holds each tensor of ``sent``
    (digest entries) as sent, naming the first that differ. Names the worker holds that were not
    sent (loaded from the checkpoint, not part of this send) are not compared. An engine whose
    workers did not all answer (a data-parallel engine left out) is an error too."""
    unanswered = answered_by_every_worker(workers)
    if unanswered is not None:
        raise EngineError(f"{name}: {unanswered}")
    for rank, held in enumerate(workers):
        entries = held_digest_entries(held)
        differ = sorted(n for n in sent if entries.get(n) != sent[n])
        if not differ:
            continue
        never = [n for n in differ if n not in entries]
        raise EngineError(
            f"{name}: worker {rank} does not hold the weights just sent ({len(differ)} tensors differ, "
            f"first {differ[:3]}{f'; never loaded: {never[:3]}' if never else ''}; recorded "
            f"{held.get('method')!r}): the transfer lost or changed them, or the engine's dtype is not "
            "the one sent"
        )


def send_verified(engine, source, clients: list[SignedClient], *, rank: int | None = None) -> str:
    """``engine.send_weights()`` (a vLLM trainer engine built on ``source``), then on the sender
    check that every engine the send reached (``clients``: one per engine, whichever client drove
    the send) holds what ``source`` yielded. Returns the digest sent. Every trainer rank calls it
    (the send is a collective)."""
    engine.send_weights()
    is_sender = getattr(engine, "is_sender", True) if rank is None else rank == 0
    digest = source.digest()
    if is_sender:
        for client in clients:
            check_held(client.url, client.held_weights(), source.sent)
    return digest
