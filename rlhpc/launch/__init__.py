"""The job shell, above the training loop: submission (launch/submission.py), Slurm and the local
executor, one backend object per kind (backend.py), Ray's bring-up, the job's tasks (job.py),
sweeps and follow-up jobs. What runs inside one start, below the driver, is rlhpc/runtime/."""
