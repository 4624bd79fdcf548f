"""A ZeRO-2 and an FSDP2 training step with round-to-nearest vs keyed SR, side by side.

    python bench/distributed.py                  # 2 ranks on gloo (CPU), tiny Llama
    python bench/distributed.py --world 2 --steps 12 --hidden 512

In each rank both variants of an engine are built from the same weights and stepped in
alternation (RTN, SR, RTN, SR, ...), each step between barriers, so load and noise hit both
alike; the table shows median step times and the SR/RTN ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tiny_llama(hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 8 * 8,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def deepspeed_engine(model, sr: bool):
    from dist_sr.integrations import deepspeed as dsr

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}}
    if sr:
        config["stochastic_rounding"] = {"enabled": True, "seed": 1, "mode": "stochastic"}
    engine, *_ = dsr.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(ids):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    return step


def fsdp2_step_fn(model, sr: bool):
    from torch.distributed.fsdp import fully_shard

    from dist_sr.integrations import fsdp2

    ctx = fsdp2.prepare(model, seed=1) if sr else None
    for block in model.model.layers:
        fully_shard(block, mp_policy=fsdp2.MIXED_PRECISION)
    fully_shard(model, mp_policy=fsdp2.MIXED_PRECISION)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    if ctx:
        ctx.track(opt)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def worker(rank: int, world: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ids = torch.randint(0, 2048, (4, args.seq), generator=torch.Generator().manual_seed(rank))
    results = {}
    for engine_name, make in (("ZeRO-2", deepspeed_engine), ("FSDP2", fsdp2_step_fn)):
        steps = {"RTN": make(tiny_llama(args.hidden, args.layers), sr=False),
                 "SR": make(tiny_llama(args.hidden, args.layers), sr=True)}
        times = {k: [] for k in steps}
        for i in range(args.steps + 2):
            for variant, step in steps.items():
                dist.barrier()
                t0 = time.perf_counter()
                step(ids)
                dist.barrier()
                if i >= 2:  # warm-up
                    times[variant].append(time.perf_counter() - t0)
        results[engine_name] = {k: statistics.median(v) for k, v in times.items()}
    if rank == 0:
        n = sum(p.numel() for p in tiny_llama(args.hidden, args.layers).parameters())
        print(f"# distributed step, tiny Llama ({n / 1e6:.1f}M params), {world} ranks on gloo, "
              f"{torch.get_num_threads()} threads/rank, batch 4x{args.seq}/rank\n")
        print("| engine | RTN step (ms) | SR step (ms) | SR / RTN |\n|---|---:|---:|---:|")
        for name, r in results.items():
            print(f"| {name} | {r['RTN'] * 1e3:.0f} | {r['SR'] * 1e3:.0f} | {r['SR'] / r['RTN']:.3f} |")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--json", default="bench/results/distributed.json")
    args = ap.parse_args()
    torch.multiprocessing.start_processes(worker, args=(args.world, args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
