"""Run by tests/integrations/test_trl.py under torchrun: the README's TRL example as written,
then what TRL's vLLM sync would push, read through TRL's own iterator
(``VLLMGeneration._iter_named_params``, which server and colocate mode both consume)."""

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

import trl_grpo  # noqa: E402


def pushed(trainer) -> dict[str, torch.Tensor]:
    """TRL's push iterator over this trainer's model. ``VLLMGeneration.__init__`` would start a
    vLLM engine (none in this environment); the iterator reads only these three attributes."""
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    gen = VLLMGeneration.__new__(VLLMGeneration)
    gen.model, gen.accelerator, gen._dist = trainer.model, trainer.accelerator, DistributedBackend(trainer.accelerator)
    return {n: t.detach().clone() for n, t in gen._iter_named_params()}


def main():
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    trainer = trl_grpo.main(argv)
    from dist_sr import stochastic_round
    from tests.engines.test_deepspeed import working_and_master

    engine = trainer.model_wrapped
    seed = trl_grpo.parse(argv).seed
    masters = {n: m for n, (_, m) in working_and_master(engine).items()}
    sent = pushed(trainer)
    keyed = all(
        torch.equal(
            sent[n].view(torch.int16),
            stochastic_round(m, seed=seed, step=engine.global_steps, param=n).view(torch.int16),
        )
        for n, m in masters.items()
    )
    result = {
        "steps": engine.global_steps,
        "attached": hasattr(engine, "dist_sr"),
        "names": sorted(sent) == sorted(masters),
        "keyed": keyed,
        "moved": engine.global_steps > 0
        and any(not torch.equal(a, b) for a, b in zip(sent.values(), masters.values())),
        "logged": sorted({k for h in trainer.state.log_history for k in h if k.startswith("dist_sr/")}),
        "unfollowed": [
            h["dist_sr/unfollowed_frac"] for h in trainer.state.log_history if "dist_sr/unfollowed_frac" in h
        ],
    }
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        import deepspeed
        from safetensors.torch import load_file

        # the checkpoint's tensors as saved (from_pretrained here would partition them under ZeRO-3)
        loaded = load_file(str(Path(trainer.args.output_dir) / "model" / "model.safetensors"))
        expect = {n: t.to(torch.bfloat16) for n, t in loaded.items()}
        params = list(ref.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            result["ref_as_loaded"] = all(
                torch.equal(p.detach().view(torch.int16), expect[n].view(torch.int16)) for n, p in params
            )
        result["ref_attached"] = hasattr(ref, "dist_sr")
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(result))
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/dist_utils.py: no store teardown race after the work is done


if __name__ == "__main__":
    main()
