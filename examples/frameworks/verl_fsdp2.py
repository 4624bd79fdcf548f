"""verl's FSDP2 worker pattern with keyed SR. In verl (v0.7): ``ActorRolloutRefWorker.
_build_model_optimizer`` loads the actor in FP32 and calls ``apply_fsdp2`` with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; ``rollout_mode`` hands
``state_dict()`` full tensors (FP32 masters) to ``ServerAdapter.update_weights``, which casts
them ``weight.to(dtype)`` (round-to-nearest) for vLLM. Three changes: ``fsdp2.prepare`` before
``apply_fsdp2``; ``ctx.track(actor_optimizer)`` (its post-step hook counts only the steps
``_optimizer_step`` takes, not the ones it skips for a non-finite norm); and
``export_bf16(name, tensor)`` in place of the cast in ``update_weights`` (or in ``rollout_mode``).

    torchrun --nproc-per-node 2 examples/frameworks/verl_fsdp2.py
"""

import argparse

import torch

from common import batch, finish, forward_weights, init, report, rtn_mismatch, tiny_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    rank, world = init()
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from dist_sr import export_bf16
    from dist_sr.engines import fsdp2

    model = tiny_model()  # verl builds the actor in FP32 for FSDP
    ctx = fsdp2.prepare(model, seed=1234)  # change 1: before verl's apply_fsdp2
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # verl's actor default
    for layer in model.model.layers:  # apply_fsdp2: each decoder layer, then the root
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    actor_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx.track(actor_optimizer)  # change 2: the key's step follows the optimizer
    for step in range(a.steps):  # DataParallelPPOActor.update_policy: backward, _optimizer_step
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        actor_optimizer.step()
        actor_optimizer.zero_grad()
    used = forward_weights(model, batch(99))  # what the trainer's forward pass used at this step
    # the rollout sync: verl collects state_dict() full tensors and casts them to the rollout dtype
    masters, exported = {}, {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        masters[name] = fsdp2.plain(full)
        exported[name] = export_bf16(name, full)  # change 3: instead of full.to(torch.bfloat16)
    ok = report(exported, used, "verl-fsdp2", world=world, key_step=ctx.step,
                rtn_cast_mismatch=round(rtn_mismatch(masters, used), 4))["bitwise_equal"]
    finish(ok)


if __name__ == "__main__":
    main()
