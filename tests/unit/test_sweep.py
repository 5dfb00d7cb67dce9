"""Sweeps: parsing --sweep, the task list, refusals before anything is written."""

import re
from pathlib import Path

import pytest

from rlhpc.errors import ConfigError, RlhpcError, RunDirError
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


def test_a_shared_fleet_sweep_is_planned_or_refused_with_the_fix(tmp_path):
    """--shared-fleet: every task attaches to the sweep's fleet file; tasks that cannot share
    engines are refused before anything is written, naming the task and the key."""
    from rlhpc.launch.fleet import fleet_settings
    from rlhpc.launch.submission import Submission, check_options, submit

    sweep = SweepDir(tmp_path / "s")

    def plan(*overrides: str, sweeps=("actor.lr=1e-3,1e-2",)):
        return plan_sweep(EMBEDDED, list(overrides), parse_sweeps(list(sweeps)), sweep, False, shared_fleet=True)

    tasks = plan("actor.lora.rank=8", sweeps=["actor.lora.rank=8,16", "actor.lr=1e-3,1e-2"])
    assert {t.cfg.rollout.fleet for t in tasks} == {str(sweep.fleet_file)} and len(tasks) == 4
    serving = fleet_settings(tasks)  # room for the largest rank; K adapters and the base in a batch
    assert serving.max_lora_rank == 16 and serving.target_modules == ("all",) and serving.max_loras_per_batch == 8
    many = plan(
        "actor.lora.rank=4", "actor.lora.target_modules=[q_proj]", sweeps=["seed=" + ",".join(map(str, range(9)))]
    )
    assert fleet_settings(many).max_loras_per_batch == 10 and fleet_settings(many).target_modules == ("q_proj",)
    for overrides, sweeps, said, fix in (
        ((), ["actor.lr=1e-3,1e-2"], "the run trains no LoRA adapter", "set actor.lora"),
        (("actor.lora.rank=8", "actor.lora.push=merged"), ["seed=1,2"], "pushes merged weights", "set actor.lora"),
        (("actor.lora.rank=8", "rollout.max_staleness=1", "cluster.gpus_per_node=2"), ["seed=1,2"],
         "rollout.max_staleness = 1", "rollout.max_staleness: 0"),
        (("actor.lora.rank=8",), ["deterministic=true,false"], "task 1 (deterministic=false) has another deterministic",
         "sweep only keys the engines do not see"),
        (("actor.lora.rank=8",), ["model.tiny.hidden_size=32,64"], "has another model", "drop --shared-fleet"),
        (("actor.lora.rank=8", "rollout.backend=sglang"), ["seed=1,2"], "rollout.backend = sglang", "rollout.backend: cpu"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(said)) as e:
            plan(*overrides, sweeps=sweeps)
        assert fix in e.value.fix
    assert not sweep.path.exists()  # planning writes nothing
    slurm = Submission(EMBEDDED, sweep.path, ("actor.lora.rank=8",), "slurm", sweeps=("seed=1,2",), shared_fleet=True)
    with pytest.raises(RlhpcError, match="--shared-fleet on Slurm") as e:
        submit(slurm)
    assert "--cluster local" in e.value.fix and not sweep.path.exists()  # refused before anything is submitted
    for s, said in (
        (Submission(EMBEDDED, tmp_path, shared_fleet=True), "--shared-fleet without --sweep"),
        (Submission(EMBEDDED, tmp_path, shared_fleet=True, max_parallel=2), "--shared-fleet with --max-parallel"),
    ):
        with pytest.raises(ConfigError, match=said):
            check_options(s, [("seed", ["1", "2"])] if s.max_parallel else [])
