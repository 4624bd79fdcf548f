"""NeMo-RL's DTensor policy worker pattern with keyed SR. In NeMo-RL (V1 worker):
``DTensorPolicyWorkerImpl.__init__`` loads the model in FP32 and ``_parallelize_model`` calls
``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32,
output_dtype=fp32)``; refit (``broadcast_weights_for_collective``, and
``dtensor_params_generator`` for ``stream_weights_via_ipc_zmq``) sends each ``state_dict()``
tensor as ``full_tensor().to(dtype)``. Three changes: ``fsdp2.prepare`` before
``_parallelize_model``; ``ctx.track(self.optimizer)``; ``export_bf16(name, full_tensor)`` in
place of the ``.to(dtype)`` in both refit paths. The refit here is the collective one: trainer
rank 0 broadcasts each tensor (every rank of this job receives it and compares).

    torchrun --nproc-per-node 2 examples/frameworks/nemo_rl_dtensor.py
"""

import argparse

import torch
import torch.distributed as dist
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

    model = tiny_model()
    ctx = fsdp2.prepare(model, seed=99)  # change 1
    # NeMo-RL also sets output_dtype=fp32 (its model code casts at the head); the plain HF model here does not
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx.track(optimizer)  # change 2
    for step in range(a.steps):
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    used = forward_weights(model, batch(99))
    masters, received = {}, {}
    for name, tensor in model.state_dict().items():  # broadcast_weights_for_collective
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        masters[name] = fsdp2.plain(full)
        out = export_bf16(name, full).contiguous()  # change 3: instead of full.to(self.dtype)
        buf = out if rank == 0 else torch.empty_like(out)
        dist.broadcast(buf, src=0)  # the inference side receives rank 0's bits
        received[name] = buf
    ok = report(
        received,
        used,
        "nemo-rl-dtensor",
        world=world,
        key_step=ctx.step,
        rtn_cast_mismatch=round(rtn_mismatch(masters, used), 4),
    )["bitwise_equal"]
    finish(ok)


if __name__ == "__main__":
    main()
