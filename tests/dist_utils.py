"""Run a function on N real processes joined by a gloo process group."""

import importlib.util
import multiprocessing.forkserver
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_sr.net import free_port  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parents[1]

# Workers fork from a server process that imported the heavy third-party modules once per test
# session (each spawned worker paid ~5 s importing them: every rank of every multi-process test).
# The server starts at the first run_workers call, from the environment as it was when this module
# was imported (so a test's monkeypatched variables never leak into its imports), with DeepSpeed on
# the CPU; each worker then takes its test's environment as it is at the call.
_PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.models.qwen2.modeling_qwen2", "deepspeed")
_SESSION_ENV = dict(os.environ)
_server_started = False


def _context():
    global _server_started
    ctx = mp.get_context("forkserver")
    if not _server_started:
        ctx.set_forkserver_preload([m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0]) is not None])
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(_SESSION_ENV, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server_started = True
    return ctx


def launcher_env() -> dict:
    """Environment for launcher subprocesses (torchrun, deepspeed): this venv's tools first, no
    inherited rank variables, one thread per rank, DeepSpeed on the CPU, the repository importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    return env


def _entry(rank, world_size, port, fn, args, errors, env):
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # the environment variable comes too late: torch is already imported
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # nobody tears down while a peer still talks to it
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()
    # Skip interpreter finalisation: destroying rank 0's TCP store server while a peer's
    # connection is still closing aborts the process ("terminate called without an active
    # exception") even though the work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_workers(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes (forked from the
    preloaded server, with this process's environment); re-raise failures."""
    ctx = _context()
    crash = None
    errors = ctx.SimpleQueue()
    port = free_port()
    try:
        mp.start_processes(
            _entry,
            args=(world_size, port, fn, args, errors, dict(os.environ)),
            nprocs=world_size,
            start_method="forkserver",
            join=True,
        )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        crash = exc
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(failures)))
    if crash is not None:
        raise AssertionError(f"a worker died without a Python traceback: {crash}")
