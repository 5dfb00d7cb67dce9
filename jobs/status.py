#!/usr/bin/env python3
"""Where a run stands: Slurm state and restarts, Ray readiness, newest checkpoint, last metrics.

python jobs/status.py runs/exp1        # a run dir
python jobs/status.py 4242             # a Slurm job id
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhpc.checkpoint import CheckpointManager  # noqa: E402
from rlhpc.metrics import read_metrics  # noqa: E402


def slurm_job(job_id: str) -> dict[str, str] | None:
    try:
        out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)


def run_dir_of_job(info: dict[str, str]) -> Path | None:
    """submitit writes task logs to RUN_DIR/logs/submitit/, so StdOut names the run dir."""
    out = Path(info.get("StdOut", ""))
    return out.parents[2] if len(out.parents) > 3 and out.parent.name == "submitit" else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="run dir or Slurm job id")
    args = p.parse_args()

    target = Path(args.target)
    info = None
    if target.is_dir():
        run, job_file = target.resolve(), target / "slurm_job_id"
        job_id = job_file.read_text().strip() if job_file.is_file() else None
    elif args.target.replace("_", "").isdigit():
        job_id = args.target
        info = slurm_job(job_id)
        run = run_dir_of_job(info) if info else None
        if run is None:
            print(f"error: Slurm does not know job {job_id} (finished long ago?)\n  fix: pass the run dir instead")
            return 2
    else:
        print(f"error: {args.target} is neither a run dir nor a job id\n  fix: pass e.g. runs/embedded or 4242")
        return 2

    print(f"run dir      {run}")
    if job_id:
        info = info or slurm_job(job_id)
        if info:
            print(f"slurm job    {job_id}: {info.get('JobState')} ({info.get('Reason')}), restarts {info.get('Restarts', '0')}, "
                  f"nodes {info.get('NodeList')}, run time {info.get('RunTime')} of {info.get('TimeLimit')}")  # fmt: skip
        else:
            print(f"slurm job    {job_id}: no longer known to Slurm")
        attempts = sorted((run / "ray").glob(f"job_{job_id}.*"), key=lambda p: int(p.suffix[1:]))
        ray_dir = attempts[-1] if attempts else run / "ray" / "none"  # the newest attempt of the job
        if (ray_dir / "head.json").is_file():
            nodes = sorted(ray_dir.glob("node_*.json"))
            head = json.loads((ray_dir / "head.json").read_text())["address"]
            stopped = " (stopped)" if (ray_dir / "stop").exists() else ""
            print(f"ray          head {head}, {len(nodes)} node(s) started{stopped} (attempt {ray_dir.suffix[1:]})")
    ck = CheckpointManager(run / "checkpoints", keep_last=2).latest() if (run / "checkpoints").is_dir() else None
    print(f"checkpoint   {ck.path.name + f' (next rollout {ck.next_rollout_id})' if ck else 'none yet'}")
    records = read_metrics(run)
    if records:
        last = records[-1]
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in last.items() if not k.startswith("time/")}
        print(f"last metrics {json.dumps(shown)}")
    print(f"finished     {(run / 'FINISHED').read_text().strip() if (run / 'FINISHED').is_file() else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
