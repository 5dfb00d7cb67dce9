"""Where a run stands: Slurm state and restarts, Ray readiness, newest checkpoint, last metrics.

python jobs/status.py runs/exp1        # a run dir
python jobs/status.py 4242             # a Slurm job id
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlhpc.checkpoint import CheckpointManager
from rlhpc.launch import slurm
from rlhpc.metrics import read_metrics
from rlhpc.run_dir import RunDir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="run dir or Slurm job id")
    args = p.parse_args(argv)

    target = Path(args.target)
    info = None
    if target.is_dir():
        run = RunDir(target)
        job_id = run.read_job_id()
    elif args.target.replace("_", "").isdigit():
        job_id = args.target
        info = slurm.show_job(job_id)
        # submitit writes task logs to RUN_DIR/logs/submitit/, so StdOut names the run dir.
        run = RunDir.from_submitit_log(info.get("StdOut", "")) if info else None
        if run is None:
            print(f"error: Slurm does not know job {job_id} (finished long ago?)\n  fix: pass the run dir instead")
            return 2
    else:
        print(f"error: {args.target} is neither a run dir nor a job id\n  fix: pass e.g. runs/embedded or 4242")
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
    ck = CheckpointManager(run.checkpoints, keep_last=2).latest(content=False) if run.checkpoints.is_dir() else None
    print(f"checkpoint   {ck.path.name + f' (next rollout {ck.next_rollout_id})' if ck else 'none yet'}")
    records = read_metrics(run)
    if records:
        last = records[-1]
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in last.items() if not k.startswith("time/")}
        print(f"last metrics {json.dumps(shown)}")
    print(f"finished     {run.finished_file.read_text().strip() if run.is_finished() else 'no'}")
    return 0
