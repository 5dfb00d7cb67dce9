"""Where a run stands: Slurm state and restarts, Ray readiness, start-up phases, newest checkpoint, last metrics.

python jobs/status.py runs/exp1        # a run dir
python jobs/status.py 4242             # a Slurm job id
python jobs/status.py runs/sweep1      # a sweep dir: one row per task
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlhpc.checkpoint import CheckpointManager
from rlhpc.errors import RlhpcError
from rlhpc.launch import slurm
from rlhpc.metrics import MetricsFileCorrupt, eval_means, read_metrics
from rlhpc.run_dir import RunDir, SweepDir
from rlhpc.runtime.startup import read_startup


def build_parser() -> argparse.ArgumentParser:
    """This command's options; the docs test checks the commands the docs show against it."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="run dir or Slurm job id")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        return show(args.target)
    except RlhpcError as e:
        print(f"error: {e}")
        return 2


def show(target_arg: str) -> int:
    """Print where the run ``target_arg`` (a run dir or a Slurm job id) stands; the exit status."""
    target = Path(target_arg)
    if SweepDir.is_sweep(target):
        print_sweep(SweepDir(target))
        return 0
    info = None
    if target.is_dir():
        run = RunDir(target)
        job_id = run.read_job_id()
    elif target_arg.replace("_", "").isdigit():
        job_id = target_arg
        info = slurm.show_job(job_id)
        # submitit writes task logs to RUN_DIR/logs/submitit/, so StdOut names the run dir.
        run = RunDir.from_submitit_log(info.get("StdOut", "")) if info else None
        if run is None:
            print(f"error: Slurm does not know job {job_id} (finished long ago?)\n  fix: pass the run dir instead")
            return 2
    else:
        print(f"error: {target_arg} is neither a run dir nor a job id\n  fix: pass e.g. runs/embedded or 4242")
        return 2

    print(f"run dir      {run}")
    if job_id:
        info = info or slurm.show_job(job_id)
        if info:
            print(f"slurm job    {job_id}: {info.get('JobState')} ({info.get('Reason')}), restarts {info.get('Restarts', '0')}, "
                  f"nodes {info.get('NodeList')}, run time {info.get('RunTime')} of {info.get('TimeLimit')}")  # fmt: skip
        else:
            print(f"slurm job    {job_id}: no longer known to Slurm")
        ray = run.latest_ray_state(job_id)  # the newest attempt of the job
        if ray is not None and ray.head.is_file():
            head = json.loads(ray.head.read_text())["address"]
            stopped = " (stopped)" if ray.stop.exists() else ""
            print(f"ray          head {head}, {len(ray.nodes())} node(s) started{stopped} (attempt {ray.attempt})")
    for line in startup_lines(run):
        print(line)
    ck = CheckpointManager(run.checkpoints, keep_last=2).latest(content=False) if run.checkpoints.is_dir() else None
    print(f"checkpoint   {ck.path.name + f' (next rollout {ck.next_rollout_id})' if ck else 'none yet'}")
    try:
        records = read_metrics(run)
    except MetricsFileCorrupt as e:  # the rest of the status still helps: shown, and the problem named
        print(f"last metrics unreadable: {e.problem}\n  fix: {e.fix}")
        records, code = [], 1
    else:
        code = 0
    if records:
        last = records[-1]
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in last.items() if not k.startswith("time/")}
        print(f"last metrics {json.dumps(shown)}")
    print(f"finished     {run.finished_file.read_text().strip() if run.is_finished() else 'no'}")
    ended = None if run.is_finished() else run.read_ended()
    if ended is not None:  # the last job gave up: say how, and what to do
        print(f"ended        {ended.get('state', '?').upper()} (job {ended.get('job_id', '?')}, {ended.get('at', '?')}): "
              f"{ended.get('reason', '')}")  # fmt: skip
    from rlhpc.runtime.restarts import read_history

    starts = read_history(run)
    if starts:
        print(
            f"starts       {len(starts)} (the last at {starts[-1].get('time', '?')}, from rollout {starts[-1].get('next_rollout_id', '?')})"
        )
    return code


def task_row(run: RunDir) -> dict[str, str]:
    """One sweep task at a glance: Slurm state, restarts, rollouts trained, last eval reward."""
    from rlhpc.runtime.restarts import read_history

    job_id = run.read_job_id()
    info = slurm.show_job(job_id) if job_id else None
    if run.is_finished():
        state = "FINISHED"
    elif (ended := run.read_ended()) is not None:
        state = str(ended.get("state", "?")).upper()
    elif info:
        state = info.get("JobState", "?") + (" (held)" if slurm.hold_reason(info) else "")
    else:
        state = "not running" if job_id else "not started"
    try:
        records = read_metrics(run) if run.metrics_file.is_file() else []
    except MetricsFileCorrupt:
        records, state = [], f"{state} (metrics.jsonl corrupt)"
    trained = [r["rollout_id"] for r in records if r["kind"] == "rollout"]
    evals = [r for r in records if r["kind"] == "eval"]
    return {
        "job": job_id or "-",
        "state": state,
        "restarts": str(max(0, len(read_history(run)) - 1)),
        "rollouts": str(max(trained) + 1 if trained else 0),
        # the default eval set's mean, or the first named set's
        "eval reward": next((f"{v:.3f}" for v in eval_means(evals[-1]).values()), "-") if evals else "-",
    }


def print_sweep(sweep: SweepDir) -> None:
    spec = sweep.read_spec() or []
    print(
        f"sweep dir    {sweep} ({len(spec)} tasks, job array {sweep.job_id_file.read_text().strip() if sweep.job_id_file.is_file() else '-'})"
    )
    rows = [{"task": str(i), **task_row(sweep.task(i)), "overrides": ", ".join(o)} for i, o in enumerate(spec)]
    if not rows:
        return
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
    print("  ".join(k.ljust(w) for k, w in widths.items()))
    for r in rows:
        print("  ".join(r[k].ljust(w) for k, w in widths.items()))


def startup_lines(run: RunDir) -> list[str]:
    """The newest start's phases: when each began and ended, in seconds since the job started."""
    phases = read_startup(run)
    if not phases:
        return []
    newest = max(phases, key=lambda p: p["ended_s"])
    reached = "first rollout" if newest["phase"] == "first_rollout" else f"still starting, {newest['phase']} done"
    where = f"job {newest['job_id'] or '-'} started {newest['started_at']}"
    lines = [f"start-up     {where}: {reached} after {newest['ended_s']:.1f} s"]
    for p in phases:
        lines.append(f"  {p['phase']:<15} {p['began_s']:7.1f} -> {p['ended_s']:7.1f} s  ({p['seconds']:.1f} s)")
    return lines
