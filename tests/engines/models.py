"""The tiny model the integration tests shard."""

import torch


def tiny_qwen2():
    """A seeded FP32 Qwen2 with awkward shapes: the 3-row embedding and lm_head leave rank 3 of 4
    with an empty shard, and the 41-row MLP matrices split unevenly at world sizes 2 and 4."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=3, hidden_size=24, intermediate_size=41, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                         tie_word_embeddings=False, initializer_range=0.25)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)
