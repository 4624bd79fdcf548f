"""Run a function on N real processes joined by a gloo process group."""

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


def _entry(rank, world_size, port, fn, args, errors):
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
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; re-raise failures."""
    ctx = mp.get_context("spawn")
    crash = None
    errors = ctx.SimpleQueue()
    port = free_port()
    try:
        mp.start_processes(
            _entry, args=(world_size, port, fn, args, errors), nprocs=world_size, start_method="spawn", join=True
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
