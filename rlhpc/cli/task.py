"""Per-task entry for sbatch templates (no submitit pickle): ``srun python -m rlhpc.launch.task RUN_DIR``.

The run dir must have been prepared first (``python jobs/submit.py --prepare-only ...``, once,
in the batch script). Every task runs the same ``TrainJob`` that submitit would run; a
requeue or hold leaves through its ``SystemExit`` with the code Slurm needs. "Task" here is
Slurm's (one process per node of the step); a toy dataset is ``data.task`` (rlhpc/data/tasks.py).
"""

from __future__ import annotations

import os
import sys

from rlhpc.errors import RlhpcError
from rlhpc.launch.job import TrainJob


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m rlhpc.launch.task RUN_DIR   (inside srun, one task per node)", file=sys.stderr)
        return 2
    # submitit.JobEnvironment reads the Slurm variables once it knows it runs under Slurm.
    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")
    try:
        TrainJob(argv[0])()
    except RlhpcError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
