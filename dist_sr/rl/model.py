"""Policy models: a tiny Qwen2 built from a config, or any causal LM via ``from_pretrained``."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ConfigError, ModelConfig
from .tokenizer import VOCAB_SIZE, char_tokenizer


def build_tiny(config: ModelConfig, tokenizer):
    """A from-config ``Qwen2ForCausalLM`` sized by ``config`` (FP32, seeded init)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if config.hidden_size % config.num_attention_heads:
        raise ConfigError("model.hidden_size must be a multiple of model.num_attention_heads")
    hf_config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        max_position_embeddings=64,
        initializer_range=config.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.init_seed)
        return Qwen2ForCausalLM(hf_config)


def load_pretrained(path: str | Path):
    """Model (FP32 parameters) and tokenizer from a local directory or hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(path)
    if not local.exists() and (str(path).startswith((".", "/")) or local.suffix):
        raise ConfigError(f"model.path {path!r} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model, tokenizer


def new_tiny(config: ModelConfig):
    tokenizer = char_tokenizer()
    return build_tiny(config, tokenizer), tokenizer
