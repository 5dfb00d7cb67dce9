"""Sweeps: the Cartesian product of ``--sweep KEY=V1,V2,...`` as ONE Slurm job array.

Task i of a sweep is an ordinary run in its own run dir (``SWEEP_DIR/task_NNN``, see
``SweepDir``) with its overrides in its own config.yaml: its own owner, restart history,
requeue (``scontrol requeue ARRAY_TASK``, e.g. ``77_3``, touches that task only), checkpoints
and resume. The sweep dir adds ``sweep.json``, which names the tasks, so a resubmission of the
same sweep submits the unfinished tasks only and a different sweep in the same dir is refused.
Every task's config is loaded and validated before anything is written or submitted.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import submitit

from rlhpc.config import Config
from rlhpc.errors import ConfigError, RlhpcError, RunDirError
from rlhpc.launch import run_owner
from rlhpc.launch.fleet import fleet_settings
from rlhpc.launch.job import TrainJob
from rlhpc.launch.run_owner import Owner
from rlhpc.launch.slurm import SlurmOptions, slurm_executor
from rlhpc.preflight import load_config
from rlhpc.run_dir import RunDir, SweepDir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepTask:
    index: int
    overrides: tuple[str, ...]  # the task's own KEY=VALUE, applied after the command's --set
    cfg: Config
    run: RunDir

    def describe(self) -> str:
        return ", ".join(self.overrides)


def _split_values(text: str) -> list[str]:
    """``1e-4,3e-4`` -> two values; commas inside ``[...]``, ``{...}`` or quotes stay (YAML lists)."""
    values, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append(text[start:i])
            start = i + 1
    values.append(text[start:])
    return [v.strip() for v in values]


def parse_sweeps(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["actor.lr=1e-4,3e-4", "seed=1,2"]`` -> ``[("actor.lr", ["1e-4", "3e-4"]), ("seed", ["1", "2"])]``."""
    out: dict[str, list[str]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--sweep {item!r} is not KEY=V1,V2,...", "write e.g. --sweep actor.lr=1e-4,3e-4")
        values = _split_values(raw)
        if not raw.strip() or any(not v for v in values):
            raise ConfigError(
                f"--sweep {item!r} has {'no values' if not raw.strip() else 'an empty value'}",
                f"give {key} one or more comma-separated values, e.g. --sweep {key}=V1,V2",
            )
        if key in out:
            raise ConfigError(f"--sweep {key} is given twice", f"give all values of {key} in one --sweep")
        out[key] = values
    return list(out.items())


def plan_sweep(
    config: Path,
    overrides: list[str],
    sweeps: list[tuple[str, list[str]]],
    sweep: SweepDir,
    force: bool,
    shared_fleet: bool = False,
) -> list[SweepTask]:
    """Every task of the sweep, its config loaded and checked: refusals come before anything is
    written. ``shared_fleet``: each task attaches to the sweep's fleet (``rollout.fleet``)."""
    fleet = [f"rollout.fleet={sweep.fleet_file}"] if shared_fleet else []
    if (sweep.path / "config.yaml").is_file() and not SweepDir.is_sweep(sweep.path):
        raise RunDirError(
            f"{sweep.path} holds a single run, not a sweep", "pass --run-dir a new directory for the sweep"
        )
    combos = [tuple(f"{k}={v}" for k, v in zip((k for k, _ in sweeps), values))
              for values in itertools.product(*(vs for _, vs in sweeps))]  # fmt: skip
    old = sweep.read_spec()
    if old is not None and old != [list(c) for c in combos]:
        raise RunDirError(
            f"sweep dir {sweep.path} holds another sweep ({len(old)} task(s): {'; '.join(', '.join(o) for o in old[:4])}"
            f"{' ...' if len(old) > 4 else ''})",
            "resubmit that sweep unchanged to resume it, or pass a new --run-dir",
        )
    tasks = []
    for i, combo in enumerate(combos):
        try:
            cfg = load_config(config, [*overrides, *combo, *fleet])
        except ConfigError as e:
            raise ConfigError(f"sweep task {i} ({', '.join(combo)}): {e.problem}", e.fix) from None
        task = SweepTask(i, combo, cfg, sweep.task(i))
        if not task.run.is_finished():  # a finished task is kept as it is, and skipped
            task.run.check(cfg, force=force)
            run_owner.check_free(task.run)
        tasks.append(task)
    if shared_fleet:
        fleet_settings(tasks)  # the tasks can share engines, or the refusal names the key they differ in
    return tasks


def unfinished(tasks: list[SweepTask]) -> list[SweepTask]:
    done = [t.index for t in tasks if t.run.is_finished()]
    if done:
        log.info("sweep tasks %s are finished: not submitted again", ", ".join(map(str, done)))
    return [t for t in tasks if not t.run.is_finished()]


def submit_array(sweep: SweepDir, tasks: list[SweepTask], opts: SlurmOptions, max_parallel: int | None, force: bool):
    """Claim the unfinished tasks' run dirs, prepare them and submit ONE job array; each task's
    run dir is then owned by its array task (``77_3``). Returns [(task, job)]."""
    pending = unfinished(tasks)
    if not pending:
        log.info("every task of sweep %s is finished: nothing to submit", sweep)
        return []
    me = Owner.submitter()
    claimed: list[RunDir] = []
    try:
        for t in pending:
            run_owner.claim(t.run, me)
            claimed.append(t.run)
        for t in pending:
            t.run.prepare(t.cfg, force=force)
        sweep.write_spec([list(t.overrides) for t in tasks])
        executor = slurm_executor(pending[0].run, opts, folder=sweep.submitit_dir, max_parallel=max_parallel)
        jobs = executor.submit_array([TrainJob(str(t.run.path)) for t in pending])
    except BaseException:
        for run in claimed:
            run_owner.release(run, me)
        raise
    array_id = jobs[0].job_id.split("_")[0]
    sweep.write_job_id(array_id)
    for t, job in zip(pending, jobs):
        t.run.write_job_id(job.job_id)
        run_owner.hand_over(t.run, me, Owner.slurm_job(job.job_id))
    log.info(
        "submitted sweep %s as Slurm job array %s: %d task(s)%s, %d node(s) x %d GPU(s) each",
        sweep, array_id, len(jobs), f", at most {max_parallel} at once" if max_parallel else "", opts.nodes,
        opts.gpus_per_node,
    )  # fmt: skip
    for t, job in zip(pending, jobs):
        log.info("  task %d (%s): job %s, run dir %s", t.index, t.describe(), job.job_id, t.run)
    log.info("status: python jobs/status.py %s    plot: python tools/plot_metrics.py %s", sweep, sweep)
    return list(zip(pending, jobs))


def run_locally(
    sweep: SweepDir,
    tasks: list[SweepTask],
    run_one: Callable[[SweepTask], submitit.Job],
    follow: Callable[[SweepTask, submitit.Job], int],
) -> list[tuple[SweepTask, str]]:
    """The local executor runs the unfinished tasks one after another; a failed task does not
    stop the others. Returns the failures, with why."""
    sweep.write_spec([list(t.overrides) for t in tasks])
    failed = []
    for t in unfinished(tasks):
        log.info("sweep task %d (%s): %s", t.index, t.describe(), t.run)
        try:
            follow(t, run_one(t))
        except RlhpcError as e:
            log.error("sweep task %d failed: %s", t.index, e)
            failed.append((t, e.problem))
    return failed
