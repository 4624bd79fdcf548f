"""The precision comparison: every mode from several start checkpoints and seeds, one report.

``dist-sr compare [CONFIG]`` warms up one start checkpoint per ``start_seeds`` entry (the warm-up
seed: its data order and evaluation prompts), then trains each run (precision, learning-rate
scale, shadow jitter) from each checkpoint with each RL seed, optionally at each learning rate of
``lrs`` (a sweep), in parallel processes. It writes ``report.md`` (tables: mean and spread over
start checkpoints and over seeds, per-checkpoint values, the sweep), ``figure.png`` (and
``sweep.png``) and ``summary.json``. Finished runs are reused, so an interrupted comparison picks
up where it stopped.

``config`` reads a comparison and names its runs, ``runner`` trains them, ``summary`` reduces
their metrics to a ``RunSummary`` per run and checks the claims, ``report`` writes the tables and
figures.
"""

from .config import Cell, CompareConfig, RunSpec, cells, label, load_compare, run_config, run_dir, run_seeds
from .report import write_report
from .runner import report_comparison, run_comparison
from .summary import RunSummary, Spread, StartSummary, goal_checks, summarize

__all__ = [
    "Cell",
    "CompareConfig",
    "RunSpec",
    "RunSummary",
    "Spread",
    "StartSummary",
    "cells",
    "goal_checks",
    "label",
    "load_compare",
    "report_comparison",
    "run_comparison",
    "run_config",
    "run_dir",
    "run_seeds",
    "summarize",
    "write_report",
]
