"""dist-sr's start-up hook: the switches a job sets in its environment or config work in code
that never imports dist-sr (``deepspeed.initialize`` in OpenRLHF, transformers' Trainer, a user's
own script; verl's workers).

The wheel ships ``dist_sr_deepspeed_hook.pth`` (``setup.py``), so ``pip install dist-sr`` alone
turns it on; ``dist-sr deepspeed-hook install`` writes the same file where a wheel did not (an
editable install). Python runs its one line at start-up, which imports the root shim
``dist_sr_deepspeed_hook`` (the name old ``.pth`` files name), which registers this module's
import finder; importing ``dist_sr`` loads nothing heavy (its public names are lazy). The finder
acts only when one of ``WATCHED`` is imported:

- ``deepspeed``: ``deepspeed.initialize`` becomes ``dist_sr.engines.deepspeed.hooked_initialize``,
  which passes every call that asks for no SR through untouched, and otherwise attaches keyed SR
  (the config's ``"stochastic_rounding"`` block, or ``DIST_SR_SEED``) or fails loudly (an
  untested DeepSpeed version, no bf16).
- ``verl.workers.engine.fsdp.transformer_impl`` with ``DIST_SR_SEED`` set: ``dist_sr.integrations.verl``
  patches verl's FSDP2 engine, as ``actor_rollout_ref.model.external_lib`` would.
- ``openrlhf.trainer.ray.ppo_actor`` with ``DIST_SR_SEED`` set: ``dist_sr.integrations.openrlhf.enable()``
  makes OpenRLHF's trainer check every rollout engine after each weight sync and log dist-sr's metrics.

- ``deepspeed.launcher.runner`` (the ``deepspeed`` command): the job's SR switch (``FORWARDED``)
  joins the variables its multi-node runners (pdsh, OpenMPI, MVAPICH, SLURM, ...) export to every
  node, which are otherwise only ``EXPORT_ENVS``' prefixes and ``.deepspeed_env``.

The finder asks every other finder on ``sys.meta_path`` for the module (``PathFinder``, and also
setuptools' editable-install finders, a zipimporter's path hooks, ...), and wraps whichever
answers, and every patch goes through ``dist_sr.patching``. ``startup_check.diagnose()`` says
whether the hook is in force in this process, and if not, why.

``DIST_SR_DEEPSPEED_HOOK=0`` turns the hook off for one process: then a job that still asks for SR
(``DIST_SR_SEED``, an enabled block) is refused at ``deepspeed.initialize``, never trained
round-to-nearest. ``dist-sr deepspeed-hook uninstall`` removes the file; ``status`` says whether
it is installed and active.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

from .. import patching
from ..startup_check import ENV, FORWARDED, PTH_LINE, PTH_NAME, SEED_ENV, active, enabled, pth_path


def _patch_deepspeed(module) -> None:
    from ..engines.deepspeed.hook import hooked_initialize

    if not getattr(module.initialize, "__dist_sr_hook__", False):
        patching.patch(module, "initialize", hooked_initialize(module.initialize), by=__name__, tag="hook")


def _guard_deepspeed(module) -> None:
    """The hook is off: a call that still asks for SR is refused instead of trained round-to-nearest.
    Imports dist-sr only when ``deepspeed.initialize`` is called (the off switch is also the way
    around a broken dist-sr install): without it, only ``DIST_SR_SEED`` can be seen."""
    import functools

    original = module.initialize
    if getattr(original, "__dist_sr_hook__", False) or getattr(original, "__dist_sr_guard__", False):
        return

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        try:
            from ..engines.deepspeed.hook import take_sr_block
        except ImportError:
            asked = f"{SEED_ENV}={os.environ[SEED_ENV]!r}" if os.environ.get(SEED_ENV, "").strip() else None
        else:
            sr, _, _ = take_sr_block(args, kwargs)
            asked = None if sr is None else f"seed {sr.seed}, mode {sr.mode}"
        if asked is not None:
            raise RuntimeError(
                f"dist-sr: this job asks for keyed stochastic rounding ({asked}: the DeepSpeed config's "
                f'"stochastic_rounding" block or {SEED_ENV}), but {ENV}={os.environ.get(ENV)!r} turns '
                f"dist-sr's hook off in this process, so DeepSpeed would train round-to-nearest. Unset "
                f"{ENV}, or drop the block and {SEED_ENV} to train without SR"
            )
        result = original(*args, **kwargs)
        try:  # still one of the job's ranks: the others learn this one has the hook off
            from ..engines.deepspeed.agree import agree
        except ImportError:
            return result
        agree(None, hook=f"off ({ENV}={os.environ.get(ENV)!r})")
        return result

    initialize.__dist_sr_guard__ = True  # type: ignore[attr-defined]
    patching.patch(module, "initialize", initialize, by=__name__, tag="guard")


def _enable_verl(module) -> None:
    if os.environ.get(SEED_ENV, "").strip():
        from . import verl  # noqa: F401  (patches verl's FSDPEngine at import)


def _enable_openrlhf(module) -> None:
    if os.environ.get(SEED_ENV, "").strip():
        from . import openrlhf

        openrlhf.enable(module)


def _forward_switch(module) -> None:
    """``deepspeed.launcher.runner``: its multi-node runners export ``FORWARDED`` to every node (off
    too: a node must see the switch the user set, to refuse it there)."""
    exports = module.EXPORT_ENVS
    exports.extend(name for name in FORWARDED if name not in exports)


# module -> what runs right after it is imported (hook on); the guard's table (hook off)
WATCHED = {
    "deepspeed": _patch_deepspeed,
    "deepspeed.launcher.runner": _forward_switch,
    "verl.workers.engine.fsdp.transformer_impl": _enable_verl,
    "openrlhf.trainer.ray.ppo_actor": _enable_openrlhf,
}
GUARDED = {"deepspeed": _guard_deepspeed, "deepspeed.launcher.runner": _forward_switch}


class _Loader(importlib.abc.Loader):
    """The module's own loader, plus ``after`` once the module has run."""

    def __init__(self, inner, after):
        self.inner, self.after = inner, after

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            self.after(module)
        except ImportError as exc:
            if not (exc.name or "").startswith("dist_sr"):
                raise
            # a broken dist-sr install must say so, not leave SR configs to round-to-nearest
            raise ImportError(
                f"dist-sr's start-up hook ({PTH_NAME}) could not import dist_sr while {module.__name__} "
                f"was imported: {exc!r}. Repair the dist-sr install, or remove the hook (`dist-sr "
                f"deepspeed-hook uninstall`; {ENV}=0 for one process)"
            ) from exc

    def __getattr__(self, name):  # resource readers etc. come from the real loader
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a watched module the way the import system would without it: the first other
    finder on ``sys.meta_path`` that answers (``PathFinder``, setuptools' editable-install
    finders, ...), whose loader it wraps."""

    def __init__(self, table: dict):
        self.table = table
        self.dist_sr_table = "watched" if table is WATCHED else "guarded"  # what startup_check reads
        self._finding: set = set()  # names being looked up here: another finder may ask again

    def find_spec(self, name, path=None, target=None):
        after = self.table.get(name)
        if after is None or name in self._finding:
            return None
        self._finding.add(name)
        try:
            spec = _spec_from_others(name, path, target)
        finally:
            self._finding.discard(name)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, after)
        return spec


def _spec_from_others(name, path, target):
    for finder in list(sys.meta_path):
        if isinstance(finder, _Finder) or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


def register() -> None:
    """Install the finder (idempotent); modules already imported are patched now. With the hook
    off, only the guard (a DeepSpeed call asking for SR is refused)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    table = WATCHED if enabled() else GUARDED
    for name, after in table.items():
        if name in sys.modules:
            after(sys.modules[name])
    sys.meta_path.insert(0, _Finder(table))


def patch_loaded() -> None:
    """Patch an already imported ``deepspeed`` (the hook's job when it was registered too late)."""
    _patch_deepspeed(sys.modules["deepspeed"])


def install(directory: str | None = None) -> str:
    """Write the .pth (atomically); returns its path."""
    path = pth_path(directory)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(PTH_LINE)
    os.replace(tmp, path)
    return path


def uninstall(directory: str | None = None) -> str | None:
    """Remove the .pth; returns its path, or None if it was not there."""
    path = pth_path(directory)
    try:
        os.remove(path)
    except FileNotFoundError:
        return None
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="dist-sr deepspeed-hook", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("action", choices=["install", "uninstall", "status"])
    ap.add_argument("--site-dir", help="directory for the .pth (default: this environment's site-packages)")
    a = ap.parse_args(argv)
    path = pth_path(a.site_dir)
    if a.action == "install":
        print(
            f"installed {install(a.site_dir)}: scripts that call deepspeed.initialize now honour the config's "
            f'"stochastic_rounding" block and {SEED_ENV} ({ENV}=0 turns it off for one process)'
        )
    elif a.action == "uninstall":
        print(f"removed {path}" if uninstall(a.site_dir) else f"not installed ({path} does not exist)")
    else:
        there = os.path.exists(path)
        print(
            f"{path}: {'installed' if there else 'not installed'}; in this process: "
            f"{'active' if active() else 'inactive'}{'' if enabled() else f' ({ENV} disables it)'}"
        )
        return 0 if there else 1
    return 0
