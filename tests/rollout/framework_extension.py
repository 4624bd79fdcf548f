"""Worker extensions the way RL frameworks configure their own (verl's
``vLLMColocateWorkerExtension``, OpenRLHF's ``WorkerWrap``): none of them mixes in anything of
dist-sr's, so the held-weights RPC must come from dist-sr's vLLM plugin alone.

``MisShardingExtension`` also stands for a tensor-parallel loading bug: imported in every worker
(vLLM resolves the extension there), it makes the fused q/k/v loader take rank 0's slice on every
rank, as a wrong ``tp_rank`` would."""


class FrameworkExtension:
    def framework_ping(self) -> str:
        return "pong"


class MisShardingExtension(FrameworkExtension):
    pass


def _take_rank_zero_slice() -> None:
    from vllm.model_executor.layers.linear import QKVParallelLinear

    real = QKVParallelLinear.weight_loader

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        rank = self.tp_rank
        self.tp_rank = 0
        try:
            return real(self, param, loaded_weight, loaded_shard_id)
        finally:
            self.tp_rank = rank

    QKVParallelLinear.weight_loader = weight_loader


_take_rank_zero_slice()
