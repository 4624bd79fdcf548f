"""Start accuracy of SmolLM2-135M-Instruct (Q4_1 GGUF, its BF16 cast) on reasoning-gym candidates:
each question as one user turn in the chat template, sampled at temperature 0.7 (the experiment's),
scored by the dataset's own score_answer on the completion's last number (exact: scored 1.0).

    .venv/bin/python docs/reports/smollm2-chain_sum/task_choice.py N MAX_NEW_TOKENS '[["chain_sum", {...}], ...]'
"""

import json
import re
import sys
import time

import reasoning_gym as rg
import torch

from dist_sr.rl.checkpoint import bf16_start
from dist_sr.rl.model import load_pretrained
from dist_sr.rl.tasks import chat_prompt
from dist_sr.rollout.base import encode_prompts
from dist_sr.rollout.sampling import sample

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def main(n: int, max_new: int, candidates: list) -> None:
    torch.set_num_threads(1)
    model, tok = load_pretrained(bf16_start("smollm2", "runs/cache"))
    model = model.to(torch.bfloat16).eval()
    for name, kw in candidates:
        ds = rg.create_dataset(name, seed=7, size=n, **kw)
        entries = [ds[i] for i in range(n)]
        ids, mask = encode_prompts(tok, [chat_prompt(tok, e["question"]) for e in entries])
        t0 = time.time()
        comp, cm = sample(
            model,
            ids,
            mask,
            max_new_tokens=max_new,
            temperature=0.7,
            generator=torch.Generator().manual_seed(0),
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
        )
        texts = tok.batch_decode(comp * cm + tok.pad_token_id * (1 - cm), skip_special_tokens=True)
        last = [(NUMBER.findall(t.replace(",", "")) or [""])[-1] for t in texts]
        scores = [ds.score_answer(a, e) for a, e in zip(last, entries)]
        exact = sum(s >= 1.0 for s in scores) / n
        cut = sum(int(m[-1]) == 1 and int(c[-1]) != tok.eos_token_id for c, m in zip(comp, cm)) / n
        print(
            f"{name} {kw}: exact {exact:.3f} mean score {sum(scores) / n:.3f} cut off {cut:.2f} "
            f"prompt tokens {ids.shape[1]} ({time.time() - t0:.0f} s)",
            flush=True,
        )
        for t, e in list(zip(texts, entries))[:3]:
            print("   Q:", repr(e["question"][:90]), "A:", repr(e["answer"]), "->", repr(t[:80]), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))
