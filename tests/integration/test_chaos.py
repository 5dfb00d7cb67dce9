"""The fault-injection soak (rlhpc/devtools/chaos.py, run as tools/chaos.py) on a few local
faults, and the invariants it checks (rlhpc/invariants.py) catching each kind of damage."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from rlhpc.invariants import violations


@pytest.fixture(scope="module")
def chaos() -> ModuleType:
    from rlhpc.devtools import chaos

    return chaos


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos")


# The module's runs train four data-parallel ranks (the soak's second layout): the one-rank
# layout is what every other local fault test runs (test_preemption, test_hang, ...).
LAYOUT = "dp4"
# Two kinds: one the job survives by itself (a requeue), one that needs the run submitted again.
# Both are kills, run with the soak's short evaluations (the undisturbed run below is theirs).
KINDS = ["rank_kill", "driver_kill"]


@pytest.fixture(scope="module")
def reference(chaos: ModuleType, workdir: Path) -> Path:
    (rows,) = {chaos.KINDS[k].num_eval for k in KINDS}
    return chaos.make_reference(workdir, "local", LAYOUT, rows)


def test_the_invariants_name_each_kind_of_damage(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(reference, run, symlinks=True)
    assert violations(run, reference) == []

    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join([*lines[:3], lines[2], *lines[3:]]))  # a rollout logged twice
    (run / "FINISHED").unlink()
    (run / "checkpoints" / ".staging-rollout_000009").mkdir()
    (run / "owner.json").write_text('{"kind": "local"}\n')
    # a process of the job left running, naming the run dir on its command line
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(run)])
    try:
        found = "\n".join(violations(run, reference))
    finally:
        sleeper.kill()
        sleeper.wait()
    twice = lines[2].split('"rollout_id": ')[1].split(",")[0]
    assert f"rollouts logged more than once: [{twice}]" in found
    assert "not finished" in found
    assert "debris in checkpoints/: ['.staging-rollout_000009']" in found
    assert "the run dir is still claimed" in found
    assert f"pid {sleeper.pid}: {sys.executable} -c import time; time.sleep(60) {run}" in found

    shutil.rmtree(run)
    shutil.copytree(reference, run, symlinks=True)
    (run / "checkpoints" / "latest").write_text("rollout_000099\n")
    assert any("`latest` is not a valid checkpoint" in v for v in violations(run, reference))

    shutil.rmtree(run)
    shutil.copytree(reference, run, symlinks=True)
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join([*lines[:-2], lines[-2].replace('"reward": ', '"reward": 1', 1), lines[-1]]))
    assert any("per-rollout metrics differ" in v for v in violations(run, reference))


def test_a_small_soak_of_local_faults_survives(chaos: ModuleType, reference: Path, workdir: Path) -> None:
    said: list[str] = []
    summary = chaos.soak(2, KINDS, 7, workdir, echo=said.append, layouts=[LAYOUT])
    assert summary["tried"] == 2
    assert summary["survived"] == 2, "\n".join(said)
    assert summary["by_kind"] == {k: {"tried": 1, "survived": 1} for k in KINDS}
    assert summary["by_layout"] == {LAYOUT: {"tried": 2, "survived": 2}}
    undisturbed = [line for line in said if line.startswith("undisturbed")]
    assert len(undisturbed) == 1 and f": {reference} (" in undisturbed[0]  # the module's: no second one made
    assert all(f"layout={LAYOUT}" in line for line in said if line.startswith("trial "))
