"""Shared pytest fixtures. Each block is self-contained; add new ones in their own section.

Layout: tests/unit (no processes beyond a short subprocess; `make test-fast`), tests/integration
(real processes: engine servers, local Ray, whole local jobs), tests/slurm (the minicluster).
Each test gets the marker of its directory (`-m unit`, `-m integration`, `-m slurm`). Helpers
shared by several test modules live in tests/support/ (imported as `support.*`); no test module
imports another."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

TESTS = Path(__file__).resolve().parent

# In CI a skip for any reason but a missing CUDA device fails the run (tests/support/ci_skips.py).
pytest_plugins = ["support.ci_skips"]


# A job a test starts imports the test plugins (rewards, filters in tests/support) as a user's
# job imports the user's own modules: from its PYTHONPATH.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)


def _kind(item: pytest.Item) -> str:
    return Path(item.fspath).resolve().relative_to(TESTS).parts[0]


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark every test with its directory: unit, integration or slurm."""
    kind = _kind(item)
    if kind in ("unit", "integration", "slurm"):
        item.add_marker(getattr(pytest.mark, kind))


# The integration modules that take longest (CI's table of seconds per module), handed out
# first: the worker that ends the Slurm tests then shares short ones, not one long module left last.
LONGEST_FIRST = (
    "test_megatron_actor.py", "test_preemption.py", "test_actor.py", "test_async.py", "test_chaos.py",
    "test_engine_restart.py", "test_hang.py", "test_multiturn.py", "test_loop.py",
)  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The Slurm tests first, so that one worker starts on them at once; then unit, then
    integration with its longest modules first."""
    order = {"slurm": 0, "unit": 1, "integration": 2}

    def key(item: pytest.Item) -> tuple[int, int]:
        name = Path(item.fspath).name
        first = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        return order.get(_kind(item), 3), first if _kind(item) == "integration" else 0

    items.sort(key=key)  # stable: the files' own order within each


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``make test`` runs two pytest-xdist workers (``-n 2``). Every Slurm test is in one unit of
    work (one minicluster, used by one test at a time), every other module a unit of its own (its
    module fixtures, e.g. an undisturbed baseline run, are made once): one worker spends the run on
    the Slurm tests, much of it waiting on Slurm and Ray, and the other takes the modules in turn.
    (pytest-xdist's own ``--dist loadgroup`` did not group anything with pytest 9.2, measured.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SlurmTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/slurm" if path.startswith("tests/slurm/") else path

    return SlurmTogether(config, log)


# Seconds spent per worker's share (the Slurm tests on one worker, the rest on the other), summed
# from every test's setup, call and teardown: CI prints them so the long pole can be seen at once.
_SPENT: dict[str, float] = {}
# The same per test module (setup + call + teardown, module fixtures included): the table of the
# slowest in docs/development.md is copied from this, so cuts are measured, not estimated.
_BY_MODULE: dict[str, list[float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    share = "slurm" if report.nodeid.startswith("tests/slurm/") else "unit+integration"
    _SPENT[share] = _SPENT.get(share, 0.0) + report.duration
    module = _BY_MODULE.setdefault(report.nodeid.split("::", 1)[0], [0.0, 0])
    module[0] += report.duration
    module[1] += report.when == "call"


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (None where there is none)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


_CPU_AT_START = _cpu_times()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _SPENT:
        shares = ", ".join(f"{share} {seconds / 60:.1f} min" for share, seconds in sorted(_SPENT.items()))
        terminalreporter.write_line(f"time spent in tests by share: {shares}")
    if _BY_MODULE:
        terminalreporter.write_sep("-", "seconds per test module (setup + call + teardown), slowest first")
        for path, (seconds, count) in sorted(_BY_MODULE.items(), key=lambda kv: -kv[1][0]):
            terminalreporter.write_line(f"{seconds:8.1f} s {count:4d} tests  {path}")
    # How busy the machine's CPUs were over the run: well under 100% says workers wait (on Slurm,
    # timeouts, sleeps) and a third worker could fill the gaps; near 100%, only cheaper tests help.
    end = _cpu_times()
    if _CPU_AT_START is not None and end is not None and end[1] > _CPU_AT_START[1]:
        busy = (end[0] - _CPU_AT_START[0]) / (end[1] - _CPU_AT_START[1])
        terminalreporter.write_line(f"CPUs busy over the run: {busy:.0%} of {os.cpu_count()} cores")


# =====================================================================================
# Every metric a test's job logged is documented (rlhpc/metric_names.py, which generates
# docs/reference/metrics.md): each module's run dirs are checked when the module is done.
# =====================================================================================


@pytest.fixture(scope="module", autouse=True)
def metrics_are_documented(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    began = time.time()
    yield
    from rlhpc.metric_names import undocumented, upgrade_eval_record

    found: dict[str, None] = {}
    for f in tmp_path_factory.getbasetemp().rglob("metrics.jsonl"):
        if f.stat().st_mtime < began:
            continue  # another module's run
        for line in f.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a torn line a test wrote on purpose
            if isinstance(record, dict):  # as readers read it (rlhpc.metrics.read_metrics)
                found.update(dict.fromkeys(f"{n} ({f})" for n in undocumented(upgrade_eval_record(record))))
    if found:
        pytest.fail("logged metrics that rlhpc/metric_names.py does not document:\n" + "\n".join(found))


# =====================================================================================
# A tiny random Llama (module scope) and a local Ray with 4 declared GPUs (module scope).
# A module that needs another model overrides `model_path` locally.
# =====================================================================================


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from rlhpc.model import TinyModelConfig, build_tiny_model  # late: unit tests need no torch

    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TinyModelConfig()))


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    import ray

    from rlhpc.launch.local_ray import NO_PRESTART_ENV

    os.environ.update(NO_PRESTART_ENV)  # as a local job's Ray: no idle workers nobody uses
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    for k in NO_PRESTART_ENV:
        os.environ.pop(k, None)


# =====================================================================================
# Slurm minicluster (rlhpc/devtools/minicluster.py, command line tools/minicluster.py)
#
# `minicluster`: a real 4-node Slurm cluster with 8 (placeholder) GPUs per node (partitions
# low and high over all of them, train = node0, gen = node1-2 and score = node3), shared
# by the whole test session and reused if an identical one is already up. SLURM_CONF is
# set in os.environ while it lives. At the end of the session it is torn down, unless
# another live pytest session still uses it (the last one out stops it), it was started
# by hand with `tools/minicluster.py up`, or RLHPC_KEEP_MINICLUSTER=1. It needs root and
# Debian's slurm-wlm + munge (.ci/install_slurm.sh); when the machine cannot run it the
# fixture FAILS with the reason and the fix, unless RLHPC_SKIP_SLURM=1, then it skips.
# Mark tests that use it with @pytest.mark.slurm.
# =====================================================================================

MINICLUSTER_NODES = 4
MINICLUSTER_GPUS_PER_NODE = 8
# Beside low and high over every node: node0 alone in `train`, node1-2 in `gen`, node3 in `score`,
# for heterogeneous jobs (score: the reward model's component).
MINICLUSTER_PARTITIONS = (("train", 1, None), ("gen", 2, None), ("score", 1, None))


@pytest.fixture(scope="session")
def minicluster_tool() -> ModuleType:
    """The rlhpc.devtools.minicluster module, once the machine is known to be able to run it."""
    if os.environ.get("RLHPC_SKIP_SLURM") == "1":
        pytest.skip("RLHPC_SKIP_SLURM=1")
    from rlhpc.devtools import minicluster as tool

    problem = None
    try:
        tool.preflight()
    except tool.MiniClusterError as e:
        problem = str(e)
    if problem:  # fail outside the except block: one clear message, no chained traceback
        pytest.fail(f"cannot run the Slurm minicluster: {problem}\n(set RLHPC_SKIP_SLURM=1 to skip)", pytrace=False)
    return tool


@pytest.fixture(scope="session")
def minicluster(minicluster_tool: ModuleType) -> Iterator:
    """A running MiniCluster (see rlhpc/devtools/minicluster.py); SLURM_CONF points at it."""
    mc = minicluster_tool.MiniCluster(
        nodes=MINICLUSTER_NODES, gpus_per_node=MINICLUSTER_GPUS_PER_NODE, partitions=MINICLUSTER_PARTITIONS
    )
    problem = None
    try:
        mc.acquire()
    except minicluster_tool.MiniClusterError as e:
        problem = str(e)
    if problem:
        pytest.fail(f"Slurm minicluster did not come up: {problem}", pytrace=False)
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(mc.slurm_conf)
    try:
        yield mc
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        if os.environ.get("RLHPC_KEEP_MINICLUSTER") != "1":
            mc.release()


# ============================ end of Slurm minicluster ===============================
