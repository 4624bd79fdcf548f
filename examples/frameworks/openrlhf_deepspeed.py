"""OpenRLHF's pattern (v0.11: ``DeepspeedStrategy._ds_init_train_model`` calls
``deepspeed.initialize`` with the config ``get_train_ds_config`` builds, optimizer included;
``ActorPPOTrainer.broadcast_to_vllm`` broadcasts ``param.data`` gathered under
``GatheredParameters`` for ZeRO-3) with keyed SR. The change to OpenRLHF: the
``"stochastic_rounding"`` block in the config ``get_ds_train_config`` returns, with the hook
installed (``dist-sr deepspeed-hook install``). Nothing else: the broadcast already sends
``param.data``, the BF16 working weights, and vLLM's worker checks they are BF16.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/frameworks/openrlhf_deepspeed.py --zero-stage 3
"""

import argparse

from common import batch, finish, init, report, tiny_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero-stage", type=int, default=3, choices=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    rank, world = init()
    import deepspeed

    from deepspeed.utils import safe_get_full_fp32_param

    from dist_sr import export_bf16
    from dist_sr.engines.deepspeed import hooked_initialize

    # DeepspeedStrategy.get_ds_train_config: OpenRLHF's config, plus the SR block
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
                 "bf16": {"enabled": True}, "gradient_clipping": 1.0, "data_types": {"grad_accum_dtype": "fp32"},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                 "zero_optimization": {"stage": a.zero_stage},
                 "stochastic_rounding": {"enabled": True, "seed": 1234, "mode": "stochastic"}}
    model = tiny_model()
    # DeepspeedStrategy._ds_init_train_model: deepspeed.initialize (hooked here in-process; the
    # installed .pth hook does the same for an unmodified OpenRLHF)
    engine, _, _, _ = hooked_initialize(deepspeed.initialize)(model=model, model_parameters=model.parameters(),
                                                              config=ds_config, dist_init_required=False)
    for step in range(a.steps):  # ActorPPOTrainer.training_step: backward, strategy.optimizer_step (engine.step)
        ids = batch(step)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    # ActorPPOTrainer.broadcast_to_vllm: per parameter, gathered under ZeRO-3, param.data is broadcast
    sent = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=a.zero_stage == 3):
            sent[name] = param.data.clone()
    # the check: each is the keyed SR of its full FP32 master (collective under ZeRO-3)
    expected = {name: export_bf16(name, safe_get_full_fp32_param(param).view(param.ds_shape if a.zero_stage == 3
                                                                               else param.shape))
                for name, param in engine.module.named_parameters()}
    ok = report(sent, expected, "openrlhf-deepspeed", zero_stage=a.zero_stage, world=world,
                key_step=engine.dist_sr.step)["bitwise_equal"]
    finish(ok)


if __name__ == "__main__":
    main()
