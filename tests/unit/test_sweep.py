"""Sweeps: parsing --sweep, the task list, refusals before anything is written."""

from pathlib import Path

import pytest

from rlhpc.errors import ConfigError, RunDirError
from rlhpc.launch.sweep import parse_sweeps, plan_sweep
from rlhpc.run_dir import SweepDir

EMBEDDED = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "embedded.yaml"


def test_parse_sweeps():
    assert parse_sweeps(["actor.lr=1e-4, 3e-4", "actor.adam_betas=[0.9,0.95],[0.8,0.9]"]) == [
        ("actor.lr", ["1e-4", "3e-4"]),
        ("actor.adam_betas", ["[0.9,0.95]", "[0.8,0.9]"]),  # commas inside a YAML list stay
    ]
    for bad, said in (
        ("actor.lr", "is not KEY=V1,V2"),
        ("actor.lr=", "has no values"),
        ("seed=1,,2", "an empty value"),
    ):
        with pytest.raises(ConfigError, match=said):
            parse_sweeps([bad])
    with pytest.raises(ConfigError, match="given twice"):
        parse_sweeps(["seed=1", "seed=2"])


def test_plan_is_the_cartesian_product_and_a_different_sweep_is_refused(tmp_path):
    sweep = SweepDir(tmp_path / "s")
    tasks = plan_sweep(
        EMBEDDED, ["rollout.num_rollout=3"], parse_sweeps(["seed=1,2", "actor.lr=1e-4,3e-4,1e-3"]), sweep, False
    )
    assert [t.overrides for t in tasks][:4] == [
        ("seed=1", "actor.lr=1e-4"), ("seed=1", "actor.lr=3e-4"), ("seed=1", "actor.lr=1e-3"), ("seed=2", "actor.lr=1e-4"),
    ]  # fmt: skip
    assert len(tasks) == 6 and tasks[5].cfg.seed == 2 and tasks[5].cfg.actor.lr == 1e-3
    assert tasks[5].cfg.rollout.num_rollout == 3 and tasks[5].run.path == sweep.path / "task_005"
    assert not sweep.path.exists()  # planning writes nothing
    sweep.write_spec([list(t.overrides) for t in tasks])
    assert (
        len(
            plan_sweep(
                EMBEDDED, ["rollout.num_rollout=3"], parse_sweeps(["seed=1,2", "actor.lr=1e-4,3e-4,1e-3"]), sweep, False
            )
        )
        == 6
    )
    with pytest.raises(RunDirError, match="holds another sweep"):
        plan_sweep(EMBEDDED, [], parse_sweeps(["seed=1,3"]), sweep, False)
    single = tmp_path / "single"
    single.mkdir()
    (single / "config.yaml").write_text("{}")
    with pytest.raises(RunDirError, match="holds a single run"):
        plan_sweep(EMBEDDED, [], parse_sweeps(["seed=1,3"]), SweepDir(single), False)
