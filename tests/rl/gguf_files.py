"""Tiny GGUF checkpoints written with the ``gguf`` package, as llama.cpp's converter writes them
(llama tensor names, Q/K rows permuted for its rotary layout, a byte-level BPE tokenizer with a
ChatML chat template): what the GGUF loading tests and the real-engine run load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


MERGES = ["i s", "Ġ +"]  # a BPE file needs merges (transformers' GGUF reader drops an empty list)


def byte_vocab() -> list[str]:
    """GPT-2's byte-to-unicode alphabet (256 symbols), the merged tokens, the two ChatML specials."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    merged = [m.replace(" ", "") for m in MERGES]
    return [chr(c) for _, c in sorted(zip(bs, cs))] + merged + ["<|im_start|>", "<|im_end|>"]


def tiny_llama(hidden: int = 128, heads: int = 2, kv_heads: int = 1, layers: int = 1, seed: int = 0):
    """A random FP32 ``LlamaForCausalLM`` over ``byte_vocab()`` (head_dim 64: vLLM's CPU attention
    serves head sizes from 32 up)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = byte_vocab()
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=len(vocab) - 2,
        eos_token_id=len(vocab) - 1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.1)
    return model


def _permute(w: torch.Tensor, n_head: int) -> np.ndarray:
    """llama.cpp's row order for Q and K (transformers' GGUF loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).numpy()


def write_gguf(model, path: Path) -> Path:
    """``model`` (a ``tiny_llama``) as an F32 GGUF file with its tokenizer and chat template."""
    import gguf

    c = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c.vocab_size)
    vocab = byte_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([gguf.TokenType.NORMAL] * (len(vocab) - 2) + [gguf.TokenType.CONTROL] * 2)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(c.eos_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"].numpy())
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"].numpy())
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"].numpy())
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"].numpy())
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"].numpy())
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"].numpy())
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
