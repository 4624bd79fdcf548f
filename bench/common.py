"""What every benchmark here shares: candidates timed side by side in one round-robin loop."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def round_robin(
    candidates: dict[str, Callable[[], object]], rounds: int, device: str = "cpu", warmup: int = 1
) -> dict[str, float]:
    """Median seconds per call of each candidate. One call of each per round, in turn, so machine
    noise hits all alike; wall time between device synchronisations (host work included)."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def tiny_llama(
    hidden: int, layers: int, *, vocab: int = 2048, positions: int = 256, device: str = "cpu", align: int = 8
):
    """A Llama-shaped model built from a config (seeded), ``intermediate`` ~8/3 of ``hidden``
    rounded down to a multiple of ``align``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // align * align,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=positions,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def deepspeed_step(model, *, stage: int, sr: bool, batch: int = 4) -> Callable:
    """One DeepSpeed BF16 training step of ``model`` at ZeRO ``stage``, the config's SR block on or off."""
    from dist_sr.engines import deepspeed as dsr

    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}},
    }
    if sr:
        config["stochastic_rounding"] = {"enabled": True, "seed": 1, "mode": "stochastic"}
    engine, *_ = dsr.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(ids):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    return step
