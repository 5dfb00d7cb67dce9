"""What runs inside the allocation: bring up Ray, run the driver, mark the run finished.

``TrainJob`` is the callable submitit pickles. It carries only the run directory: all resume
state is read from disk, so a requeue (or a node-failure rerun of the original pickle)
continues from the newest checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from contextlib import contextmanager

import submitit

from rlhpc.config import ClusterConfig
from rlhpc.logs import setup_logging
from rlhpc.run_dir import RunDir

log = logging.getLogger(__name__)


@contextmanager
def local_ray(cluster: ClusterConfig, slots: int):
    """A private single-node Ray: its own temp dir, no dashboard, GPUs declared if none exist."""
    import ray
    import torch

    real_gpus = torch.cuda.device_count()
    num_gpus = real_gpus or cluster.num_nodes * cluster.gpus_per_node
    if not real_gpus:
        # submitit's local executor sets CUDA_VISIBLE_DEVICES="" on a GPU-less machine, and Ray
        # then refuses declared GPUs; with no device to hide, the variable carries no meaning.
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    # Every slot is a {GPU:1, CPU:1} bundle; Ray's CPU count is a scheduling token, not a thread.
    num_cpus = max(os.cpu_count() or 1, slots + 2)
    temp_dir = tempfile.mkdtemp(prefix="rlhpc-ray-")
    try:
        ray.init(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            _temp_dir=temp_dir,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
            log_to_driver=True,
        )
        log.info("local Ray up: %d CPUs, %d GPUs (%s)", num_cpus, num_gpus, "real" if real_gpus else "declared")
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


class TrainJob(submitit.helpers.Checkpointable):
    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self) -> dict:
        from rlhpc.cluster.layout import plan_layout
        from rlhpc.driver import make_progress, train

        run = RunDir(self.run_dir)
        cfg = run.load_config()
        console = setup_logging(cfg.logging.level)
        if run.is_finished():  # a requeue or resubmission of a finished run has nothing to do
            log.info("run %s is already finished", run)
            return {"already_finished": True}
        with local_ray(cfg.cluster, plan_layout(cfg.cluster).num_slots), make_progress(console) as progress:
            summary = train(cfg, run, progress)
        run.mark_finished(summary)
        log.info("run finished: %s", run)
        return summary
