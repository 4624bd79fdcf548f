"""The launch path's host side alone, on a machine without a GPU: every device launch recorded
instead of run (bench/host_cost.py, tests/numerics/test_triton.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

from . import adamw_launch, sr_launch, tables
from . import kernels as tk
from . import keys as triton_keys
from . import launcher as la


@dataclass
class DryRun:
    """What ``dry_run`` recorded: each launch as (kernel name, grid, arguments), ``jit`` the ones
    that went through Triton's JIT (a specialization's first call), the others launched directly."""

    launches: list = field(default_factory=list)
    jit: list = field(default_factory=list)


class _DryKernel:
    """Stands in for a compiled kernel: ``run`` records the launch."""

    def __init__(self, name: str, record: DryRun):
        self.name, self.record = name, record
        self.function = self.packed_metadata = None

    def run(self, grid, _y, _z, _stream, _function, _metadata, _hook_meta, _enter, _exit, *args) -> None:
        self.record.launches.append((self.name, grid, args))


class _DryJIT:
    """Stands in for a ``triton.jit`` function: a launch records itself and returns a ``_DryKernel``."""

    def __init__(self, fn: Any, record: DryRun):
        self.arg_names, self.name, self.record = fn.arg_names, fn.__name__, record

    def __getitem__(self, grid):
        def launch(*args, num_warps=None, **kw):
            full = args + tuple(kw[n] for n in self.arg_names[len(args) :] if n in kw)  # as a direct launch lists them
            self.record.launches.append((self.name, grid[0], full))
            self.record.jit.append(self.name)
            return _DryKernel(self.name, self.record)

        return launch


def _reset() -> None:
    sr_launch.ONE.clear()
    la.LAUNCHERS.clear()
    tables.TABLES.clear()
    adamw_launch.SCALES.clear()


@contextlib.contextmanager
def dry_run() -> Iterator[DryRun]:
    """Run the launch path's host side on CPU tensors with every device launch recorded instead
    of run: what a call costs the host, and which launches it makes with which arguments, measured
    and tested without a GPU. Everything is as on a GPU (specializations compiled once, then
    launched directly with raw addresses; cached tables) except that nothing runs on a device;
    the caches are emptied before and after."""
    record = DryRun()
    kernels = {m: {n: getattr(m, n) for n in dir(m) if n.endswith("_kernel")} for m in (tk, triton_keys)}
    stand_ins = {
        "interpreting": lambda: False,
        "check_device": lambda tensors: tensors[0].device,
        "current_device": lambda: -1,  # a CPU tensor's get_device()
        "raw_stream": lambda device: 0,
    }
    saved = {n: getattr(la, n) for n in stand_ins}
    _reset()
    try:
        for m, fns in kernels.items():
            for n, fn in fns.items():
                setattr(m, n, _DryJIT(fn, record))
        for n, f in stand_ins.items():
            setattr(la, n, f)
        yield record
    finally:
        for m, fns in kernels.items():
            for n, fn in fns.items():
                setattr(m, n, fn)
        for n, f in saved.items():
            setattr(la, n, f)
        _reset()
