"""GRPO with TRL and keyed SR: a stock ``GRPOTrainer`` script; the change for SR is one call
(``dsr_trl.enable``) and ``bf16=True``.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/trl_grpo.py --zero-stage 2
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 1 examples/trl_grpo.py --zero-stage 3 --beta 0.04

Without ``--model`` it trains a tiny Qwen2 it saves to ``<output-dir>/model`` first (this machine
has no model hub); with a GPU and vLLM, add ``--use-vllm``: the weights TRL pushes to vLLM are the
trainer's keyed BF16 bits. Metrics (``dist_sr/unfollowed_frac``, ``dist_sr/key_step``) go wherever
``--report-to`` says (TensorBoard by default).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def tiny_model(path: Path) -> str:
    """A from-config Qwen2 with the character tokenizer, saved as a local checkpoint (rank 0)."""
    import torch.distributed as dist

    from dist_sr.rl.config import ModelConfig
    from dist_sr.rl.model import new_tiny

    if not dist.is_initialized() or dist.get_rank() == 0:
        if not (path / "config.json").exists():
            model, tok = new_tiny(
                ModelConfig(
                    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1, init_seed=0
                )
            )
            model.save_pretrained(path)
            tok.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return str(path)


def build_trainer(a: argparse.Namespace):
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from dist_sr.integrations import trl as dsr_trl
    from dist_sr.rl.tasks import Addition

    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    task, rng = Addition(num_digits=1), random.Random(0)
    examples = [task.sample(rng) for _ in range(64)]
    data = Dataset.from_dict({"prompt": [e.prompt for e in examples], "answer": [e.answer for e in examples]})

    def correct(completions, answer, **_):
        return [task.reward(c, x) for c, x in zip(completions, answer)]

    ds_config = out / "ds.json"
    ds_config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "bf16": {"enabled": "auto"},
                "gradient_clipping": "auto",
                "zero_optimization": {"stage": a.zero_stage},
            }
        )
    )
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=a.steps,
        learning_rate=a.lr,
        beta=a.beta,
        bf16=True,
        deepspeed=str(ds_config),
        use_vllm=a.use_vllm,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to=a.report_to,
        save_strategy="no",
        model_init_kwargs={"dtype": torch.float32},
    )
    model = a.model or tiny_model(out / "model")
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=args, train_dataset=data)
    dsr_trl.enable(trainer, seed=a.seed, sticking=True)  # the one line SR needs (sticking: log the metric)
    return trainer


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a local checkpoint or hub id (default: a tiny model made here)")
    ap.add_argument("--output-dir", default="runs/trl-grpo")
    ap.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--beta", type=float, default=0.0, help="KL weight (> 0 builds TRL's reference model)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=77, help="the rounding key's seed")
    ap.add_argument("--use-vllm", action="store_true")
    ap.add_argument("--report-to", nargs="*", default=["tensorboard"])
    ap.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)  # deepspeed launcher
    return ap.parse_args(argv)


def main(argv=None):
    trainer = build_trainer(parse(argv))
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
