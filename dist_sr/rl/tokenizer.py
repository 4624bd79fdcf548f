"""A character-level tokenizer for the generated tasks, as a real Hugging Face tokenizer.

Built with the ``tokenizers`` library and wrapped in ``PreTrainedTokenizerFast``, so it saves
with ``save_pretrained`` and loads back with ``AutoTokenizer.from_pretrained`` like any other.
"""

from __future__ import annotations

CHARS = "0123456789=+-"
SPECIALS = ("<bos>", "<eos>", "<pad>")
VOCAB_SIZE = len(CHARS) + len(SPECIALS)  # 16


def char_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab.update({s: len(CHARS) + i for i, s in enumerate(SPECIALS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<pad>"
    )
    hf.padding_side = "left"
    return hf
