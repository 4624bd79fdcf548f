"""What the peer tests share: a real vLLM engine process they drive (``tests.peers.vllm_engine``),
a tiny Qwen2 checkpoint, the trainer's keyed bits, and forward-pass capture."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client
from pathlib import Path

import torch

from dist_sr.net import free_port
from dist_sr.numerics.digest import combine, tensor_sums
from dist_sr.rollout.vllm.native import digest_entries
from tests.engines.models import forward_weights  # noqa: F401  (re-exported for the peer tests)

REPO = Path(__file__).resolve().parents[2]


class Engine:
    """A vLLM engine in its own process (this environment's vLLM), driven over a connection."""

    def __init__(
        self, model_dir: Path, extension: str, log: Path, *, env: dict | None = None, load_format: str = "auto"
    ):
        self.address = ("127.0.0.1", free_port())
        self.authkey = os.urandom(16)
        cmd = [
            sys.executable,
            "-m",
            "tests.peers.vllm_engine",
            str(model_dir),
            f"{self.address[0]}:{self.address[1]}",
            extension,
            load_format,
        ]
        self.log = log
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {}), "DIST_SR_PEER_AUTHKEY": self.authkey.hex()},
        )
        self.conn = None

    def wait_ready(self, timeout: float = 600) -> "Engine":
        deadline = time.monotonic() + timeout
        while "engine ready" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM engine did not start ({self.proc.poll()}):\n{self.log.read_text()[-5000:]}")
            time.sleep(1)
        return self

    def call(self, *cmd):
        """One command on this process's connection (opened on first use; ``release`` lets a
        trainer process connect instead: the engine serves one client at a time)."""
        if self.conn is None:
            self.conn = Client(self.address, authkey=self.authkey)
        self.conn.send(cmd)
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine: {value}")
        return value

    def release(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def close(self) -> None:
        """Ask the engine to quit, then kill it; an engine stuck in a command (a push whose trainer
        died) gets 30 s, not a hang."""

        def quit_():
            try:
                self.call("quit")
            except (OSError, EOFError, RuntimeError):
                pass

        asking = threading.Thread(target=quit_, daemon=True)
        asking.start()
        asking.join(30)
        self.proc.kill()
        self.proc.wait()


class GlooBroadcast:
    """Stand-in for a peer's NCCL weight-update group (PyNccl over vLLM's ``StatelessProcessGroup``
    in OpenRLHF), which cannot run without GPUs: the same ``broadcast(tensor, src, stream)`` over a
    gloo group between the trainer's rank 0 and the engine's workers."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float = 120):
        from datetime import timedelta

        import torch.distributed as dist

        store = dist.TCPStore(host, port, world, rank == 0, timeout=timedelta(seconds=timeout_s))
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("peer-weights", store), rank, world, timedelta(seconds=timeout_s)
        )
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor.view(-1).view(torch.uint8)], opts).wait()  # the bytes, as NCCL moves them
        self.sent.append(tensor.detach().clone())


@contextlib.contextmanager
def cuda_calls_on_cpu():
    """A peer's CUDA calls around a weight transfer, on the CPU: ``torch.cuda.current_stream``
    (a broadcast's stream argument) and ``torch.empty(..., device="cuda")`` (a receive buffer)."""
    real_empty, real_stream = torch.empty, torch.cuda.current_stream

    def empty(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return real_empty(*args, **kwargs)

    torch.empty, torch.cuda.current_stream = empty, lambda *a, **k: None
    try:
        yield
    finally:
        torch.empty, torch.cuda.current_stream = real_empty, real_stream


PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]


def check_push(tmp_path: Path, model_dir: Path, extension: str, push, env: dict | None = None) -> None:
    """Start a real engine, let ``push(engine)`` push the trainer's weights into it the way a peer
    does (writing the trainer's expected bits to ``expected.pt`` and the engine's held-weights
    report to ``held.json`` in ``tmp_path``), then check: the engine holds exactly those bits
    (digest), and generates the tokens of an engine started from a checkpoint of them."""
    import json

    pushed = Engine(model_dir, extension, tmp_path / "engine.log", env=env).wait_ready()
    try:
        push(pushed)
        tokens = pushed.call("generate", PROMPTS, 8)
    finally:
        pushed.close()
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    held = json.loads((tmp_path / "held.json").read_text())
    assert held["method"] == "recorded at load"
    assert digest_of(held["digests"]) == trainer_digest(expected)  # the engine holds the trainer's bits
    fresh = Engine(
        save_with_weights(model_dir, tmp_path / "keyed-model", expected), extension, tmp_path / "fresh.log", env=env
    ).wait_ready()
    try:
        assert fresh.call("generate", PROMPTS, 8) == tokens
    finally:
        fresh.close()


def digest_of(entries: dict) -> str:
    """The layout-free digest of ``dist_sr_held_weights`` entries."""
    return combine(digest_entries(entries))


def trainer_digest(tensors: dict[str, torch.Tensor]) -> str:
    return combine(tensor_sums(tensors))


def save_tiny_model(path: Path, seed: int = 0) -> Path:
    """A from-config Qwen2 (head_dim 64; vLLM's CPU attention serves head sizes from 32 up), in BF16."""
    from dist_sr.rl.config import ModelConfig
    from dist_sr.rl.model import new_tiny

    model, tok = new_tiny(
        ModelConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, init_seed=seed)
    )
    model.to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def save_with_weights(src: Path, dst: Path, weights: dict[str, torch.Tensor]) -> Path:
    """``src``'s checkpoint with ``weights`` (BF16, HF names) in place of its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names where ``a`` and ``b`` differ in dtype, shape or any bit (empty when equal)."""
    bad = sorted(set(a) ^ set(b))
    for n in set(a) & set(b):
        x, y = a[n].contiguous(), b[n].contiguous()
        if (
            x.dtype != y.dtype
            or x.shape != y.shape
            or not torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        ):
            bad.append(n)
    return sorted(bad)
