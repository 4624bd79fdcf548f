"""``dist-sr doctor``: in this interpreter and environment, would keyed SR attach to DeepSpeed,
FSDP2, TRL, verl and OpenRLHF, and if not, why.

It looks where a job would: whether the start-up hook is in force (its ``.pth`` processed, or why
Python did not run it: ``python -S``, a zipapp, a directory that is on ``sys.path`` but is not a
site directory as ``pip install --target``, ``PYTHONPATH`` and Ray's ``py_modules``/``working_dir``
leave dist-sr, a hook turned off), what the environment asks for (``DIST_SR_SEED``), whether the
``deepspeed`` launcher run from here would export the switch to every node (and what a
``.deepspeed_env`` overrides), then each framework: installed, its version in dist-sr's window or
its classes as dist-sr needs them, and the way SR attaches to it. Run it where the job runs (on
each node, in the job's environment): ``dist-sr doctor``, or ``python -m dist_sr.launch.cli doctor``
with the job's interpreter and flags. Exit status 0 when every installed framework would get SR.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import startup_check as hook


@dataclass(frozen=True)
class Finding:
    """One line of the report: ``attaches`` is None where the framework is not installed."""

    name: str
    attaches: bool | None
    text: str

    def line(self) -> str:
        state = "not installed" if self.attaches is None else "attaches" if self.attaches else "does NOT attach"
        return f"{self.name:<10}{state}" + (f": {self.text}" if self.text else "")


def _version(dist: str, module=None) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return str(getattr(module, "__version__", "?"))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def switch() -> tuple[bool, str]:
    """``(fine, words)`` on what this environment asks for."""
    from ..engines.deepspeed.config import MODE_ENV, SEED_ENV, env_config

    try:
        sr = env_config()
    except ValueError as exc:
        return False, f"{exc}"
    if sr is None:
        return True, f"{SEED_ENV} is unset: the environment asks for no SR (a DeepSpeed JSON's block still can)"
    return True, f"{SEED_ENV}={sr.seed}, {MODE_ENV}={sr.mode}: this environment asks for keyed SR"


def forwarding() -> tuple[bool, str] | None:
    """Whether ``deepspeed --hostfile`` run from here exports the switch to every node; None
    without DeepSpeed."""
    if not _installed("deepspeed"):
        return None
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher import runner

    exports = list(runner.EXPORT_ENVS) + list(get_accelerator().export_envs())
    dropped = [v for v in hook.FORWARDED if not any(v.startswith(prefix) for prefix in exports)]
    lines = []
    ok = not dropped
    if dropped:
        lines.append(
            f"`deepspeed --hostfile` run from here exports only variables starting with {', '.join(exports)}: "
            f"{', '.join(dropped)} would NOT reach the other nodes (dist-sr's hook adds them where it is in force). "
            f"List them in the .deepspeed_env where you launch (e.g. {hook.SEED_ENV}=1234), or put the "
            '"stochastic_rounding" block in the DeepSpeed JSON'
        )
    else:
        lines.append(f"`deepspeed --hostfile` run from here exports {', '.join(hook.FORWARDED)} to every node")
    for directory in runner.DEEPSPEED_ENVIRONMENT_PATHS:
        path = Path(directory, runner.DEEPSPEED_ENVIRONMENT_NAME)
        if not path.is_file():
            continue
        for raw in path.read_text().splitlines():
            key, sep, value = raw.partition("=")
            key, value = key.strip(), value.strip()
            if sep and key in hook.FORWARDED:
                here = os.environ.get(key)
                lines.append(
                    f"{path} sets {key}={value}, which every node gets"
                    + ("" if here in (None, value) else f" (this shell's {here} is overridden)")
                )
    return ok, "; ".join(lines)


def deepspeed_finding() -> Finding:
    if not _installed("deepspeed"):
        return Finding("deepspeed", None, "")
    from ..engines.deepspeed.version import UnsupportedDeepSpeed, check_version

    served = hook.served_by("deepspeed")
    try:
        import deepspeed
    except Exception as exc:  # a broken install, or the hook's own refusal to import it
        return Finding("deepspeed", False, f"importing deepspeed failed: {exc}")
    about = f"DeepSpeed {deepspeed.__version__} (found by {served})"
    try:
        check_version(deepspeed.__version__)
    except UnsupportedDeepSpeed as exc:
        return Finding("deepspeed", False, f"{about}: {exc}")
    init = deepspeed.initialize
    if getattr(init, "__dist_sr_hook__", False):
        return Finding("deepspeed", True, f"{about}; deepspeed.initialize is dist-sr's")
    if getattr(init, "__dist_sr_guard__", False):
        return Finding("deepspeed", False, f"{about}; the hook is off (above): a job asking for SR is refused")
    return Finding(
        "deepspeed", False, f"{about}; deepspeed.initialize is DeepSpeed's own: the hook is not in force (above)"
    )


def fsdp2_finding() -> Finding:
    import torch

    try:
        importlib.import_module("dist_sr.engines.fsdp2")
    except ImportError as exc:
        return Finding("fsdp2", False, f"torch {torch.__version__} lacks what dist-sr's FSDP2 engine needs: {exc}")
    return Finding(
        "fsdp2",
        True,
        f"torch {torch.__version__}: fully_shard with the keyed all-gather (dist-sr train, "
        "dist_sr.engines.fsdp2.prepare; no hook needed)",
    )


def trl_finding(deepspeed: Finding) -> Finding:
    if not _installed("trl"):
        return Finding("trl", None, "")
    try:
        importlib.import_module("dist_sr.integrations.trl")
        import trl
    except ImportError as exc:
        return Finding("trl", False, f"importing dist_sr.integrations.trl failed: {exc}")
    about = f"TRL {_version('trl', trl)}, dist_sr.integrations.trl.enable(trainer)"
    if deepspeed.attaches is False:
        return Finding("trl", False, f"{about}: with FSDP2 yes; with DeepSpeed no (the deepspeed line)")
    return Finding("trl", True, f"{about} (FSDP2" + (" and DeepSpeed)" if deepspeed.attaches else ")"))


def verl_finding(hook_ok: bool) -> Finding:
    if not _installed("verl"):
        return Finding("verl", None, "")
    try:
        importlib.import_module("dist_sr.integrations.verl")  # what verl's external_lib does
        import verl
    except Exception as exc:
        return Finding("verl", False, f"importing dist_sr.integrations.verl (verl's external_lib) failed: {exc}")
    alone = "also with DIST_SR_SEED alone" if hook_ok else "NOT with DIST_SR_SEED alone (the hook is not in force)"
    return Finding(
        "verl",
        True,
        f"verl {_version('verl', verl)}, with actor_rollout_ref.model.external_lib=dist_sr.integrations.verl; {alone}",
    )


def openrlhf_finding(deepspeed: Finding) -> Finding:
    if not _installed("openrlhf"):
        return Finding("openrlhf", None, "")
    if not deepspeed.attaches:
        return Finding("openrlhf", False, "its DeepSpeed engines would not get SR (the deepspeed line)")
    try:
        from ..integrations import openrlhf

        openrlhf.enable()  # what the hook does when OpenRLHF's trainer module is imported
        import openrlhf as package
    except Exception as exc:
        return Finding("openrlhf", False, f"{exc}")
    return Finding("openrlhf", True, f"OpenRLHF {_version('openrlhf', package)}, from DIST_SR_SEED in the actors' env")


def report() -> tuple[bool, list[str]]:
    """``(every installed framework gets SR and nothing is wrong, the report's lines)``."""
    from ..engines.deepspeed.agree import version

    hook_ok, hook_why = hook.diagnose()
    lines = [
        f"dist-sr doctor: {sys.executable} (Python {sys.version.split()[0]}{', -S' if sys.flags.no_site else ''}), "
        f"dist-sr {version()} from {Path(__file__).parents[1]}",
        f"start-up hook: {'in force' if hook_ok else 'NOT in force'}: {hook_why}",
    ]
    verl = verl_finding(hook_ok)  # before this process imports deepspeed (verl's workers need not)
    switch_ok, words = switch()
    lines.append(f"switch: {words}")
    fine = switch_ok
    forwarded = forwarding()
    if forwarded is not None:
        lines.append(f"multi-node: {forwarded[1]}")
        fine = fine and forwarded[0]
    ds = deepspeed_finding()
    findings = [ds, fsdp2_finding(), trl_finding(ds), verl, openrlhf_finding(ds)]
    lines += [f.line() for f in findings]
    fine = fine and all(f.attaches is not False for f in findings)
    gets = [f.name for f in findings if f.attaches]
    lines.append(
        f"verdict: SR would attach to {', '.join(gets) or 'nothing'} here"
        + ("" if fine else "; fix the lines above that say NOT")
    )
    return fine, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dist-sr doctor", description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    fine, lines = report()
    print("\n".join(lines), flush=True)
    return 0 if fine else 1
