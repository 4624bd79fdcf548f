"""The worker extension of a verl rollout engine in the peer tests: verl's own
``vLLMColocateWorkerExtension`` (its ZMQ/shared-memory receiver and ``load_weights`` path) plus
dist-sr's ``WorkerExtension`` (the held-weights record).

One stand-in: on a GPU the receiver's ``tensor.to(device)`` copies each weight out of the
shared-memory bucket; on the CPU it returns the bucket's own view, which vLLM's layerwise reload
keeps until a layer is complete (and the bucket then cannot be closed). ``_update_weights`` copies
as the GPU would, then runs verl's own."""

import tests.peers.verl_cpu  # noqa: F401  (verl's device platform, before verl reads it)

# isort: split
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from dist_sr.rollout.vllm.plugin import WorkerExtension


class Extension(vLLMColocateWorkerExtension, WorkerExtension):
    def _update_weights(self, weights, *args, **kwargs):
        return super()._update_weights([(n, t.clone()) for n, t in weights], *args, **kwargs)
