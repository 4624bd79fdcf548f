"""Turns on the DeepSpeed JSON's ``"stochastic_rounding"`` block for scripts that call
``deepspeed.initialize`` themselves: no code change, only the config.

``dist-sr deepspeed-hook install`` writes ``dist_sr_deepspeed_hook.pth`` into the environment's
site-packages; Python runs its one line at start-up, which imports this module. It imports
nothing heavy: it only registers an import finder, and when (if ever) ``deepspeed`` is imported,
it replaces ``deepspeed.initialize`` with ``dist_sr.engines.deepspeed.hooked_initialize``.
That wrapper passes every call whose config has no enabled SR block through untouched, and
otherwise attaches keyed SR (or fails loudly: an untested DeepSpeed version, no bf16).

``DIST_SR_DEEPSPEED_HOOK=0`` disables it for one process; ``dist-sr deepspeed-hook uninstall``
removes the file.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENV = "DIST_SR_DEEPSPEED_HOOK"
PTH_NAME = "dist_sr_deepspeed_hook.pth"
# the .pth line: a missing dist-sr (uninstalled without removing the file) must not break start-up
PTH_LINE = (
    "import os, sys; exec('try:\\n import dist_sr_deepspeed_hook as h\\nexcept ImportError:\\n h = None\\n"
    "if h is not None: h.register()')\n"
)


class _Loader(importlib.abc.Loader):
    """deepspeed's own loader, plus the patch once its ``__init__`` has run."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            from dist_sr.engines.deepspeed.hook import hooked_initialize
        except Exception as exc:  # a broken dist-sr install must say so, not leave SR configs to RTN
            raise ImportError(
                f"dist-sr's deepspeed hook ({PTH_NAME}) could not import dist_sr: {exc!r}. Repair "
                f"the dist-sr install, or remove the hook (`dist-sr deepspeed-hook uninstall`; "
                f"{ENV}=0 for one process)"
            ) from exc
        if not getattr(module.initialize, "__dist_sr_hook__", False):
            module.initialize = hooked_initialize(module.initialize)

    def __getattr__(self, name):  # resource readers etc. come from the real loader
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no", "off")


def register() -> None:
    """Install the finder (idempotent; a no-op when disabled or when deepspeed is already imported,
    in which case ``patch_loaded()`` does the job)."""
    if not enabled() or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    if "deepspeed" in sys.modules:
        patch_loaded()
        return
    sys.meta_path.insert(0, _Finder())


def patch_loaded() -> None:
    from dist_sr.engines.deepspeed.hook import hooked_initialize

    ds = sys.modules["deepspeed"]
    if not getattr(ds.initialize, "__dist_sr_hook__", False):
        ds.initialize = hooked_initialize(ds.initialize)


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
            f'"stochastic_rounding" block ({ENV}=0 turns it off for one process)'
        )
    elif a.action == "uninstall":
        print(f"removed {path}" if uninstall(a.site_dir) else f"not installed ({path} does not exist)")
    else:
        there = os.path.exists(path)
        active = any(isinstance(f, _Finder) for f in sys.meta_path) or getattr(
            getattr(sys.modules.get("deepspeed"), "initialize", None), "__dist_sr_hook__", False
        )
        print(
            f"{path}: {'installed' if there else 'not installed'}; in this process: "
            f"{'active' if active else 'inactive'}{'' if enabled() else f' ({ENV} disables it)'}"
        )
        return 0 if there else 1
    return 0
