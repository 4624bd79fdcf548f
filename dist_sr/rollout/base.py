"""What a rollout engine is: the ``RolloutEngine`` protocol the trainer talks to, the batch it
returns (``Rollouts``), the registry of engines, and prompt encoding shared by all of them.

An engine holds a copy of the policy's working weights (or, for the embedded engine, *is* the
policy), generates completions, and tags every batch with the weight version it used and, when
asked, the digest of those weights, so the trainer can prove that rollouts and training saw the
same bits. The trainer compares that digest with the training engine's ``expected_digest()``
(the working weights re-derived from the FP32 masters, a path independent of the bits the engine
holds), or, for an engine whose digest is of another kind, with its ``trainer_digest()``: the
trainer's weights digested that way (vLLM: the layout-free digest of the weights the trainer
sends, computed from its own pieces, against what the engine reports it received).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..registry import Registry


@dataclass
class Rollouts:
    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P] 1 for real tokens
    completion_ids: torch.Tensor  # [N, T] padded after EOS
    completion_mask: torch.Tensor  # [N, T] 1 up to and including EOS
    texts: list[str]  # decoded completions (special tokens removed)
    weight_version: int
    weight_digest: str | None
    # [N, T] the engine's log-probabilities of the tokens it sampled (0 after the mask), when the
    # engine is not the trainer's own module (the trainer then measures the mismatch)
    engine_logprobs: torch.Tensor | None = None


class RolloutEngine(Protocol):
    """Where rollouts come from (``embedded``, a ``vllm`` fleet). Called on every trainer rank.

    Class attributes (what the trainer, its checks and the renderers ask of an engine, never its
    name):
        remote: whether it runs in processes (or pods) of its own that the trainer syncs weights
            to over the network: the job then needs the sync secret.

    Class methods:
        build(config, trainer, tokenizer, device, sharded): the engine for the ``rollout``
            section ``config`` and the training engine ``trainer``'s weights.
        preflight(config): what it checks before any compute (the ``rollout`` section, on every
            rank): refuse with the fix, never fail later.

    Methods:
        sync_weights(version, verify): make the engine generate with the trainer's working weights
            of ``version``; with ``verify``, checked by digest before any rollout.
        generate(prompts, samples_per_prompt, max_new_tokens, temperature, generator,
            with_digest): ``Rollouts`` (prompt and completion ids with masks, texts, the weight
            version, and with ``with_digest`` the digest of the weights they were generated with),
            ``samples_per_prompt`` per prompt, sampled with ``generator``'s seeds.
        trainer_digest(): the trainer's weights digested the way this engine's digests are (a
            collective), or None when the training engine's ``expected_digest()`` is comparable.
        sync_metrics(): the last weight sync, for the step's metrics (``{}`` when there is none).
        close(): release what the engine holds (engines it started); called once at the end.
    """

    remote: bool

    @classmethod
    def build(cls, config, trainer, tokenizer, *, device, sharded: bool) -> RolloutEngine: ...

    @classmethod
    def preflight(cls, config) -> None: ...

    def sync_weights(self, version: int, verify: bool = True) -> None: ...

    def generate(
        self,
        prompts: list[str],
        *,
        samples_per_prompt: int,
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator,
        with_digest: bool = False,
    ) -> Rollouts: ...

    def trainer_digest(self) -> str | None: ...

    def sync_metrics(self) -> dict: ...

    def close(self) -> None: ...


# name -> a class satisfying RolloutEngine (or "module:Class", imported when first asked for)
ROLLOUT_ENGINES: Registry[type] = Registry("rollout engine")


def register_rollout_engine(name: str, cls: type | str) -> None:
    """A new rollout engine: one module and this call (see ``dist_sr/rollout/__init__.py``);
    ``cls`` may be ``"module:Class"``, imported on first use."""
    ROLLOUT_ENGINES.register(name, cls)


def rollout_engine_names() -> tuple[str, ...]:
    return ROLLOUT_ENGINES.names()


def rollout_engine_class(name: str) -> type:
    return ROLLOUT_ENGINES[name]


def make_rollout_engine(config, trainer, tokenizer, *, device, sharded: bool) -> RolloutEngine:
    """The engine ``config.engine`` (a ``RolloutConfig``) for a training engine's weights."""
    return rollout_engine_class(config.engine).build(config, trainer, tokenizer, device=device, sharded=sharded)


def encode_prompts(tokenizer, prompts: list[str], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids (with BOS where the tokenizer has one) and their mask."""
    rows = []
    for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"]:
        if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
            ids = [tokenizer.bos_token_id] + ids
        rows.append(ids)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)
