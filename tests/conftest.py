"""Shared pytest fixtures. Each block is self-contained; add new ones in their own section.

Layout: tests/unit (no processes beyond a short subprocess; `make test-fast`), tests/integration
(real processes: engine servers, local Ray, whole local jobs), tests/slurm (the minicluster).
Each test gets the marker of its directory (`-m unit`, `-m integration`, `-m slurm`). Helpers
shared by several test modules live in tests/support/ (imported as `support.*`); no test module
imports another."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its directory: unit, integration or slurm."""
    for item in items:
        kind = Path(item.fspath).resolve().relative_to(TESTS).parts[0]
        if kind in ("unit", "integration", "slurm"):
            item.add_marker(getattr(pytest.mark, kind))


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

    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


# =====================================================================================
# Slurm minicluster (tools/minicluster.py)
#
# `minicluster`: a real 4-node Slurm cluster with 8 (placeholder) GPUs per node, shared
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


def _load_minicluster_tool() -> ModuleType:
    name = "rlhpc_tools_minicluster"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / "minicluster.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def minicluster_tool() -> ModuleType:
    """The tools/minicluster.py module, once the machine is known to be able to run it."""
    if os.environ.get("RLHPC_SKIP_SLURM") == "1":
        pytest.skip("RLHPC_SKIP_SLURM=1")
    tool = _load_minicluster_tool()
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
    """A running MiniCluster (see tools/minicluster.py); SLURM_CONF points at it."""
    mc = minicluster_tool.MiniCluster(nodes=MINICLUSTER_NODES, gpus_per_node=MINICLUSTER_GPUS_PER_NODE)
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
