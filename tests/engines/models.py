"""The tiny model the integration tests shard."""

import torch


def tiny_qwen2(
    *, vocab_size: int = 3, tie_word_embeddings: bool = False, initializer_range: float = 0.25, layers: int = 2
):
    """A seeded FP32 Qwen2 with awkward shapes: the 3-row embedding and lm_head leave rank 3 of 4
    with an empty shard, and the 41-row MLP matrices split unevenly at world sizes 2 and 4."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=24,
        intermediate_size=41,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def forward_weights(model, ids) -> dict:
    """The weights each module's forward pass used (unsharded, as FSDP2 gathered them), by
    normalised parameter name."""
    from dist_sr.numerics.key import normalize_param_name

    seen, handles = {}, []
    for mod_name, mod in model.named_modules():
        if not list(mod.parameters(recurse=False)):
            continue

        def hook(m, args, kwargs, prefix=mod_name):
            for n, p in m.named_parameters(recurse=False):
                seen[normalize_param_name(f"{prefix}.{n}" if prefix else n)] = p.detach().clone()

        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    model(input_ids=ids)
    for h in handles:
        h.remove()
    return seen
