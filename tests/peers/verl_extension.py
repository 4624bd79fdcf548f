"""The worker extension of a verl rollout engine in the peer tests: verl's own
``vLLMColocateWorkerExtension`` (its ZMQ/shared-memory receiver, ``load_weights`` path and
post-processing), subclassed only for what a CPU engine needs. Nothing of dist-sr's: the
held-weights RPC comes from dist-sr's vLLM plugin, as on verl's GPU engines.

The CPU stand-ins, each for something a GPU engine does not need:

- vLLM's CPU backend repacks linear weights for oneDNN and empties their parameters, so a bare
  ``load_weights`` cannot write them after start-up: ``update_weights_from_ipc`` opens vLLM's
  layerwise reload before verl's receive and finalizes it where verl runs
  ``process_weights_after_loading`` (the reload processes each layer once it is complete; verl's
  second processing would repack the emptied weights again, which vLLM 0.24 on an AMX CPU
  attempts as a convolution weight: ``IndexError: Dimension out of range`` in
  ``dispatch_cpu_unquantized_gemm``). On a GPU, verl's own processing runs once, as written.
- on a GPU the receiver's ``tensor.to(device)`` copies each weight out of the shared-memory
  bucket; on the CPU it returns the bucket's own view, which the layerwise reload keeps until a
  layer is complete (and the bucket then cannot be closed): ``_update_weights`` copies, as the
  GPU would, then runs verl's own."""

import tests.peers.verl_cpu  # noqa: F401  (verl's device platform, before verl reads it)

# isort: split
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension


class Extension(vLLMColocateWorkerExtension):
    def update_weights_from_ipc(self, *args, **kwargs):
        import vllm.model_executor.model_loader.utils as loader_utils
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        for model in self._iter_all_models():
            initialize_layerwise_reload(model)
        process = loader_utils.process_weights_after_loading
        loader_utils.process_weights_after_loading = lambda model, model_config, device: finalize_layerwise_reload(
            model, model_config
        )
        try:
            return super().update_weights_from_ipc(*args, **kwargs)
        finally:
            loader_utils.process_weights_after_loading = process

    def _update_weights(self, weights, *args, **kwargs):
        return super()._update_weights([(n, t.clone()) for n, t in weights], *args, **kwargs)
