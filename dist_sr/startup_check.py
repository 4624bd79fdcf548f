"""Whether dist-sr's start-up hook (``integrations.startup``) is in force in this process, and if not, why: what
``dist-sr doctor``, the integrations' plug points and ``dist-sr deepspeed-hook status`` ask. Stdlib
only, and nothing of dist-sr's: every layer may ask it."""

from __future__ import annotations

import os
import sys

ENV = "DIST_SR_DEEPSPEED_HOOK"
SEED_ENV = "DIST_SR_SEED"  # dist_sr.engines.deepspeed.config.SEED_ENV, without importing dist_sr at start-up
# What the deepspeed launcher exports to every node (as prefixes of EXPORT_ENVS): the switch and
# how every rank checks it. Never a secret (DIST_SR_SYNC_SECRET): exports travel on the command line.
FORWARDED = ("DIST_SR_SEED", "DIST_SR_MODE", "DIST_SR_DEEPSPEED_HOOK", "DIST_SR_VERIFY", "DIST_SR_AGREE_TIMEOUT")
PTH_NAME = "dist_sr_deepspeed_hook.pth"
# the .pth line: a missing dist-sr (uninstalled without removing the file) must not break start-up
PTH_LINE = (
    "import os, sys; exec('try:\\n import dist_sr_deepspeed_hook as h\\nexcept ImportError:\\n h = None\\n"
    "if h is not None: h.register()')\n"
)


def served_by(name: str) -> str | None:
    """Which finder on ``sys.meta_path`` (this hook's aside) finds module ``name``, or None."""
    for finder in list(sys.meta_path):
        if _ours(finder) or not hasattr(finder, "find_spec"):
            continue
        if finder.find_spec(name, None, None) is not None:
            kind = finder if isinstance(finder, type) else type(finder)
            builtin = kind.__module__.startswith("_frozen_importlib")
            return kind.__qualname__ if builtin else f"{kind.__module__}.{kind.__qualname__}"
    return None


def _ours(finder) -> bool:
    """Whether ``finder`` is the start-up hook's (``startup._Finder``: ``table`` says which)."""
    return getattr(finder, "dist_sr_table", None) is not None


def _hooked() -> bool:
    """The hook's finder, with the hook on, is on ``sys.meta_path``."""
    return any(getattr(f, "dist_sr_table", None) == "watched" for f in sys.meta_path)


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no", "off")


def site_dir() -> str:
    """This environment's site-packages (where pip puts pure-Python packages)."""
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def pth_path(directory: str | None = None) -> str:
    return os.path.join(directory or site_dir(), PTH_NAME)


def active() -> bool:
    """Whether ``deepspeed.initialize`` is, or will be when imported, dist-sr's in this process."""
    ds = sys.modules.get("deepspeed")
    if ds is not None:
        return bool(getattr(getattr(ds, "initialize", None), "__dist_sr_hook__", False))
    return _hooked()


REGISTER_FIX = (
    "install dist-sr with pip into the environment's own site-packages (`pip install dist-sr`, not --target), "
    "or register the hook before anything imports deepspeed: `import dist_sr_deepspeed_hook; "
    "dist_sr_deepspeed_hook.register()` as the script's first lines (Ray: runtime_env "
    '{"worker_process_setup_hook": "dist_sr_deepspeed_hook.register"})'
)


def diagnose() -> tuple[bool, str]:
    """``(in force, why)``: whether the hook is in force in this process, and in words where its
    ``.pth`` is, or why Python did not run it (with the fix). Stdlib only."""
    if not enabled():
        return False, f"turned off: {ENV}={os.environ.get(ENV)!r} (unset it to turn the hook on)"
    ds = sys.modules.get("deepspeed")
    hooked = _hooked()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where dist_sr/ and the shim are
    if hooked and ds is not None and not active():
        return False, (
            "registered after deepspeed was imported: deepspeed.initialize is DeepSpeed's own; register the "
            "hook before anything imports deepspeed (or let the .pth do it: pip install dist-sr)"
        )
    if hooked or active():
        found = [d for d in _site_dirs() if os.path.exists(pth_path(d))]
        where = f"{pth_path(found[0])}, processed at start-up" if found else "registered by the program itself"
        return True, where
    sites = _site_dirs()
    in_site = [d for d in sites if os.path.exists(pth_path(d))]
    if sys.flags.no_site:
        why = "python -S: the site module is off, so no .pth file runs (dist-sr's hook included)"
    elif not os.path.isdir(here):  # an archive on sys.path: dist_sr_deepspeed_hook.py inside a zip
        why = f"dist-sr is imported from the archive {here} (a zipapp): Python never runs .pth files from archives"
    elif in_site:
        why = (
            f"{pth_path(in_site[0])} ran at start-up, but the hook is not registered in this process any more "
            "(its finder was taken off sys.meta_path)"
        )
    elif os.path.exists(pth_path(here)):
        on_path = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
        via = "through PYTHONPATH" if os.path.realpath(here) in on_path else "put on sys.path at run time"
        why = (
            f"dist-sr is imported from {here}, {via}, which is not a site directory: Python runs .pth files only "
            "in site directories (pip install --target, Ray py_modules and working_dir install like this)"
        )
    else:
        why = (
            f"no site directory ({', '.join(sites)}) holds {PTH_NAME}: an editable install without `dist-sr "
            "deepspeed-hook install`, or the file was removed"
        )
    return False, f"{why}. Fix: {REGISTER_FIX}"


def _site_dirs() -> list[str]:
    import site

    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE and site.USER_SITE:
        dirs.append(site.USER_SITE)
    return dirs
