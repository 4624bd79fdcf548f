"""Training a comparison's runs: the start checkpoints first, then every run x start x seed in
parallel worker processes, skipping finished ones (an interrupted comparison picks up where it
stopped) and those its archive holds (``archive_dir``: a comparison longer than a session)."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from ..config import ExperimentConfig
from ..cpu_math import check_pin_took, pinned
from . import archive
from .config import CompareConfig, cells, finished, run_config, run_seeds
from .report import write_report


def _warm_one(cfg: ExperimentConfig, threads: int) -> str:
    import torch

    from ..warmup import start_checkpoint

    check_pin_took()
    torch.set_num_threads(threads)  # the workers' share of the cores, not all of them each
    return start_checkpoint(cfg, progress=False)  # a warm-up, or a given checkpoint's BF16 cast


def warmup_threads(parallel: int, warmups: int) -> int:
    """Threads per warm-up when ``warmups`` start checkpoints train on ``parallel`` workers' cores:
    fewer warm-ups than workers (one start checkpoint) take the idle workers' cores too."""
    return max(1, parallel // max(1, warmups))


# A step's CPU time relative to a BF16 step (docs/reports/smollm2-chain_sum/plan.md: 18.7 s bf16 and
# bf16-sr, 23.6 s fp32, 268 s fp16 without FP16 matrix units): what orders the queue
CPU_STEP_COST = {"fp32": 1.3, "fp16": 14.0}


def run_cost(exp: ExperimentConfig) -> float:
    """A run's expected CPU time, in BF16 steps."""
    return exp.grpo.steps * CPU_STEP_COST.get(exp.precision.precision, 1.0)


def queue_order(jobs: list, parallel: int) -> list:
    """The order runs are trained in. One at a time (``parallel`` 1), the cheapest first: the order
    does not change when the last one ends, and a queue stopped early (the end of a session, a
    crash) has finished the most runs, each start checkpoint's seeds together. Several at a time,
    the longest first: the shortest time to the last one."""
    if parallel == 1:
        return sorted(jobs, key=lambda j: (run_cost(j[3]), j[1], j[2]))
    return sorted(jobs, key=lambda j: -run_cost(j[3]))


def _train_one(cfg: ExperimentConfig) -> str:
    from transformers.utils import logging as hf_logging

    from ..trainer import train

    check_pin_took()
    hf_logging.disable_progress_bar()  # one line per finished run is enough in a worker

    return str(train(cfg, progress=False, resume="auto"))  # a run cut short continues


def _start_of(exp: ExperimentConfig) -> str:
    from ..warmup import start_checkpoint

    return start_checkpoint(exp, progress=False)  # cached by now: its path


@contextmanager
def worker_pool(cfg: CompareConfig) -> Iterator[cf.ProcessPoolExecutor]:
    """The comparison's worker processes: spawned, so each starts with the environment that pins
    ``cfg.cpu_isa`` and computes with it from its first kernel."""
    with (
        pinned(cfg.cpu_isa),
        cf.ProcessPoolExecutor(max_workers=cfg.parallel, mp_context=multiprocessing.get_context("spawn")) as pool,
    ):
        yield pool


def _jobs(cfg: CompareConfig) -> list:
    return [
        (cell, start, seed, run_config(cfg, cell, start, seed))
        for cell in cells(cfg)
        for start in cfg.start_seeds
        for seed in run_seeds(cfg, cell)
    ]


def report_comparison(cfg: CompareConfig) -> Path:
    """The report of finished runs alone (``--report-only``): the archive's runs restored first,
    nothing trained; returns report.md."""
    archive.restore(cfg, [j[3] for j in _jobs(cfg)])
    return write_report(cfg)


def run_comparison(cfg: CompareConfig, progress: bool = True) -> Path:
    """Warm up every start checkpoint, train every run x start x seed (skipping finished ones),
    then write the report; returns report.md."""
    jobs = _jobs(cfg)
    archive.restore(cfg, [j[3] for j in jobs])
    todo = queue_order([j for j in jobs if not finished(j[3])], cfg.parallel)
    if not todo:  # every run finished: the report only, no worker processes
        return write_report(cfg)
    from ..warmup import start_ready

    with worker_pool(cfg) as pool:
        # the start checkpoints of the runs left (those of restored runs alone are not warmed up
        # again), the ones not cached yet before any run needs them
        first = {start: next(j[3] for j in todo if j[1] == start) for start in sorted({j[1] for j in todo})}
        cold = [exp for exp in first.values() if not start_ready(exp)]
        threads = warmup_threads(cfg.parallel, len(cold))
        warm = [pool.submit(_warm_one, exp, threads) for exp in cold]
        for fut in tqdm(
            cf.as_completed(warm), total=len(warm), desc="start checkpoints (warm-up)", disable=not progress
        ):
            fut.result()
        digests = {start: archive.checkpoint_digest(_start_of(exp)) for start, exp in first.items()}
        for start, exp in first.items():  # runs from another start checkpoint's bits are refused here
            archive.record_start(cfg, exp, digests[start])
        bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="comparison runs", disable=not progress)
        futures = {pool.submit(_train_one, exp): (cell.label, start, seed) for cell, start, seed, exp in todo}
        experiments = {fut: todo[i][3] for i, fut in enumerate(futures)}
        for fut in cf.as_completed(futures):
            fut.result()  # a failed run fails the comparison, with its traceback
            name, start, seed = futures[fut]
            archive.store(cfg, experiments[fut], digests[start])
            bar.set_postfix_str(f"done {name} start {start} seed {seed}")
            bar.update(1)
        bar.close()
    return write_report(cfg)
