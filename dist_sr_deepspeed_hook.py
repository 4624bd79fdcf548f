"""dist-sr's start-up hook: the switches a job sets in its environment or config work in code
that never imports dist-sr (``deepspeed.initialize`` in OpenRLHF, transformers' Trainer, a user's
own script; verl's workers).

The wheel ships ``dist_sr_deepspeed_hook.pth`` (``setup.py``), so ``pip install dist-sr`` alone
turns it on; ``dist-sr deepspeed-hook install`` writes the same file where a wheel did not (an
editable install). Python runs its one line at start-up, which imports this module. It imports
nothing heavy: it registers an import finder that acts only when one of ``WATCHED`` is imported:

- ``deepspeed``: ``deepspeed.initialize`` becomes ``dist_sr.engines.deepspeed.hooked_initialize``,
  which passes every call that asks for no SR through untouched, and otherwise attaches keyed SR
  (the config's ``"stochastic_rounding"`` block, or ``DIST_SR_SEED``) or fails loudly (an
  untested DeepSpeed version, no bf16).
- ``verl.workers.engine.fsdp.transformer_impl`` with ``DIST_SR_SEED`` set: ``dist_sr.integrations.verl``
  patches verl's FSDP2 engine, as ``actor_rollout_ref.model.external_lib`` would.
- ``openrlhf.trainer.ray.ppo_actor`` with ``DIST_SR_SEED`` set: ``dist_sr.integrations.openrlhf.enable()``
  makes OpenRLHF's trainer check every rollout engine after each weight sync and log dist-sr's metrics.

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

ENV = "DIST_SR_DEEPSPEED_HOOK"
SEED_ENV = "DIST_SR_SEED"  # dist_sr.engines.deepspeed.config.SEED_ENV, without importing dist_sr at start-up
PTH_NAME = "dist_sr_deepspeed_hook.pth"
# the .pth line: a missing dist-sr (uninstalled without removing the file) must not break start-up
PTH_LINE = (
    "import os, sys; exec('try:\\n import dist_sr_deepspeed_hook as h\\nexcept ImportError:\\n h = None\\n"
    "if h is not None: h.register()')\n"
)


def _patch_deepspeed(module) -> None:
    from dist_sr.engines.deepspeed.hook import hooked_initialize

    if not getattr(module.initialize, "__dist_sr_hook__", False):
        module.initialize = hooked_initialize(module.initialize)


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
            from dist_sr.engines.deepspeed.hook import take_sr_block
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
        return original(*args, **kwargs)

    initialize.__dist_sr_guard__ = True
    module.initialize = initialize


def _enable_verl(module) -> None:
    if os.environ.get(SEED_ENV, "").strip():
        import dist_sr.integrations.verl  # noqa: F401  (patches verl's FSDPEngine at import)


def _enable_openrlhf(module) -> None:
    if os.environ.get(SEED_ENV, "").strip():
        from dist_sr.integrations import openrlhf

        openrlhf.enable(module)


# module -> what runs right after it is imported (hook on); the guard's table (hook off)
WATCHED = {
    "deepspeed": _patch_deepspeed,
    "verl.workers.engine.fsdp.transformer_impl": _enable_verl,
    "openrlhf.trainer.ray.ppo_actor": _enable_openrlhf,
}
GUARDED = {"deepspeed": _guard_deepspeed}


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
    def __init__(self, table: dict):
        self.table = table

    def find_spec(self, name, path=None, target=None):
        after = self.table.get(name)
        if after is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, after)
        return spec


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no", "off")


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


def site_dir() -> str:
    """This environment's site-packages (where pip puts pure-Python packages)."""
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def pth_path(directory: str | None = None) -> str:
    return os.path.join(directory or site_dir(), PTH_NAME)


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
        active = any(isinstance(f, _Finder) and f.table is WATCHED for f in sys.meta_path) or getattr(
            getattr(sys.modules.get("deepspeed"), "initialize", None), "__dist_sr_hook__", False
        )
        print(
            f"{path}: {'installed' if there else 'not installed'}; in this process: "
            f"{'active' if active else 'inactive'}{'' if enabled() else f' ({ENV} disables it)'}"
        )
        return 0 if there else 1
    return 0
