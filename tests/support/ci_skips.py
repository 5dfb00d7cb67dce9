"""In CI (``CI=true``, which ``.ci/run`` exports) a skipped test is a failed one, unless it was
skipped for want of a CUDA device: a test that stops running (megatron-core no longer imports
after a torch bump, no root for the second user, RLHPC_SKIP_SLURM=1 left set) must turn the run
red, not quietly shrink it. A pytest plugin (``tests/conftest.py`` loads it)."""

from __future__ import annotations

import os

import pytest

ALLOWED = "CUDA device"  # the one reason CI may skip for: a skip reason must name it


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _reason(report: pytest.BaseReport) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _fail_skip(report: pytest.BaseReport) -> None:
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = _reason(report)
    if ALLOWED in reason:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped in CI: {reason}\n"
        f"CI runs every test but those that need a {ALLOWED}: fix what made it skip (install what it needs, "
        "run as root), or run outside CI (unset CI)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    _fail_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield  # a module-level importorskip / skip: the whole module's tests
    _fail_skip(outcome.get_result())
