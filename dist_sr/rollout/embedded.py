"""The embedded rollout engine: generation in-process with the trainer's own model."""

from __future__ import annotations

from ..replica import combined_digest, weight_digests
from .base import Rollouts, encode_prompts
from .sampling import sample


class EmbeddedEngine:
    """Generates in-process with the trainer's own model object (``transformers`` forward).

    Rollouts therefore use exactly the working weights the training forward pass uses; the
    digest each batch carries is computed from those weights at generation time.
    """

    remote = False  # it is the trainer's own model

    @classmethod
    def build(cls, config, trainer, tokenizer, *, device, sharded: bool) -> EmbeddedEngine:
        return cls(trainer.module, tokenizer, digest_fn=trainer.digest, stop_early=not sharded)

    @classmethod
    def preflight(cls, config) -> None:
        """Nothing to check: no process, secret or address of its own."""

    def __init__(self, model, tokenizer, *, digest_fn=None, stop_early: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.digest_fn, self.stop_early = digest_fn, stop_early
        self.version = 0

    def sync_weights(self, version: int, verify: bool = True) -> None:
        self.version = version  # same module as the trainer: nothing to copy

    def trainer_digest(self) -> None:
        """None: its digest is the training engine's own, comparable with ``expected_digest()``."""
        return None

    def sync_metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def weight_digest(self) -> str:
        """Digest of the weights generation uses (for sharded models, ``digest_fn`` is the engine's
        layout-free digest, summed from the shards)."""
        return self.digest_fn() if self.digest_fn else combined_digest(weight_digests(self.model))

    def generate(self, prompts, *, samples_per_prompt, max_new_tokens, temperature, generator, with_digest=False):
        ids, mask = encode_prompts(self.tokenizer, prompts, device=generator.device)
        ids = ids.repeat_interleave(samples_per_prompt, 0)
        mask = mask.repeat_interleave(samples_per_prompt, 0)
        was_training = self.model.training
        self.model.eval()
        try:
            comp, comp_mask = sample(
                self.model,
                ids,
                mask,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                generator=generator,
                eos_id=self.tokenizer.eos_token_id,
                pad_id=self.tokenizer.pad_token_id,
                stop_early=self.stop_early,
            )
        finally:
            self.model.train(was_training)
        texts = self.tokenizer.batch_decode(
            comp * comp_mask + self.tokenizer.pad_token_id * (1 - comp_mask), skip_special_tokens=True
        )
        return Rollouts(ids, mask, comp, comp_mask, texts, self.version, self.weight_digest() if with_digest else None)
