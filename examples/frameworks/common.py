"""Shared by the framework examples: a tiny model, a few training steps, and the check that the
tensors an exporter would hand vLLM are the trainer's keyed bits."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def init() -> tuple[int, int]:
    """torchrun's process group (gloo on CPU, nccl on GPUs)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)  # the same batch on every rank
    return torch.randint(0, 16, (4, 12), generator=g)


def report(exported: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], label: str, **extra) -> dict:
    """Compare what the exporter produced with the trainer's working weights; rank 0 prints one
    JSON line (and writes it to $EXAMPLE_RESULT if set)."""
    same = sorted(exported) == sorted(expected) and all(
        exported[n].dtype == torch.bfloat16
        and torch.equal(exported[n].view(torch.int16), expected[n].view(torch.int16))
        for n in expected
    )
    result = {"example": label, "tensors": len(exported), "bitwise_equal": same, **extra}
    if dist.get_rank() == 0:
        print(json.dumps(result))
        if os.environ.get("EXAMPLE_RESULT"):
            with open(os.environ["EXAMPLE_RESULT"], "w") as f:
                json.dump(result, f)
    return result


def finish(ok: bool) -> None:
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)  # no store teardown race once the work is done


def forward_weights(model, ids) -> dict[str, torch.Tensor]:
    """The weights each module's forward pass used (unsharded, as FSDP2 gathered them), by name."""
    from dist_sr import normalize_param_name

    seen, handles = {}, []
    for mod_name, mod in model.named_modules():
        if not list(mod.parameters(recurse=False)):
            continue

        def hook(m, args, kwargs, prefix=mod_name):
            for n, p in m.named_parameters(recurse=False):
                seen[normalize_param_name(f"{prefix}.{n}" if prefix else n)] = p.detach().clone()

        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return seen


def rtn_mismatch(masters: dict[str, torch.Tensor], working: dict[str, torch.Tensor]) -> float:
    """Fraction of elements where the round-to-nearest cast of the master (what an exporter's
    ``.to(torch.bfloat16)`` sends) differs from the working weight the trainer used."""
    diff = sum(
        int((m.to(torch.bfloat16).view(torch.int16) != working[n].view(torch.int16)).sum()) for n, m in masters.items()
    )
    return diff / sum(m.numel() for m in masters.values())
