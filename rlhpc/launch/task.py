"""Per-task entry for sbatch templates (no submitit pickle): ``srun python -m rlhpc.launch.task RUN_DIR``.

The run dir must have been prepared first (``python jobs/submit.py --prepare-only ...``, once,
in the batch script). Every task runs the same ``TrainJob`` that submitit would run.
"""

import os
import sys

from rlhpc.errors import RlhpcError
from rlhpc.launch.job import TrainJob


def main(argv: list[str]) -> int:
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
