"""The worker extension of an OpenRLHF rollout engine in the peer tests: OpenRLHF's own
``WorkerWrap`` (``update_weight``: receive a broadcast tensor, ``model.load_weights``) plus
dist-sr's ``WorkerExtension`` (the held-weights record). Stood in for: the PyNccl group
``WorkerWrap.init_process_group`` builds (``peer_weight_group`` joins a gloo one), and the CUDA
receive buffer and stream ``update_weight`` asks for."""

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from dist_sr.rollout.vllm.plugin import WorkerExtension
from tests.peers.harness import GlooBroadcast, cuda_calls_on_cpu


class Extension(WorkerWrap, WorkerExtension):
    def peer_weight_group(self, host: str, port: int, world: int) -> None:
        import torch.distributed as dist

        self._model_update_group = GlooBroadcast(host, port, dist.get_rank() + 1, world)
        self._model_update_with_ray = False

    def update_weight(self, *args, **kwargs):
        with cuda_calls_on_cpu():
            return WorkerWrap.update_weight(self, *args, **kwargs)
