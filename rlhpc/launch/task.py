"""``srun python -m rlhpc.launch.task RUN_DIR``, the sbatch templates' command: rlhpc/cli/task.py."""

from rlhpc.cli.task import main  # upward: the command line sbatch scripts already written run

if __name__ == "__main__":
    raise SystemExit(main())
