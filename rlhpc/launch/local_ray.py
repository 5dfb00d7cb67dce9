"""A local job's Ray: one private node on loopback, started by the job's one task."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from rlhpc.config import ClusterConfig
from rlhpc.runtime.signals import StopRequest
from rlhpc.util.files import NODE_TMP_ENV, private_dir, ray_temp_dir
from rlhpc.util.secrets import write_secret

log = logging.getLogger(__name__)

# Ray's switch between a cluster-wide node address and loopback (its default off on macOS/Windows).
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextmanager
def local_ray(
    cluster: ClusterConfig,
    slots: int,
    stop: StopRequest,
    token_file: Path | None = None,
    temp_dir: Path | None = None,
):
    """A private single-node Ray: its own temp dir, no dashboard, GPUs declared if none exist.

    ``stop`` starts listening once Ray's processes exist (they keep USR2 ignored).
    ``token_file``: token authentication as on Slurm, with a new random token in that 0600 file
    (``JobRayState.token``); set before ray is first imported, which reads RAY_AUTH_* then.
    ``temp_dir``: Ray's temp dir (``RunDir.local_ray_dir``), emptied first: only the run dir's
    owner gets here, so whatever is in it was left by a job of this run that was killed."""
    if token_file is not None:
        write_secret(token_file)
        os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)})
    # Every listener of a one-node Ray on loopback (issue 32, item 12): its node address is then
    # 127.0.0.1 (what Ray does on macOS), and its gRPC servers (GCS, raylet, workers, the
    # dashboard's and its agents) bind there, not on all addresses; ray.init(_node_ip_address=
    # "127.0.0.1") is turned back into the node's IP. Read when ray is first imported.
    os.environ[LOOPBACK_ONLY_ENV] = "0"
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
    if temp_dir is None:
        temp_dir = Path(tempfile.mkdtemp(prefix="rlhpc-ray-"))
    else:
        if temp_dir.exists():
            log.info("removing %s, left by a killed job of this run", temp_dir)
        private_dir(temp_dir, fresh=True)
    os.environ[NODE_TMP_ENV] = str(temp_dir)  # Ray's workers inherit it: engines' files go with the dir
    try:
        ray.init(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            _temp_dir=str(ray_temp_dir(temp_dir)),
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
            log_to_driver=True,
        )
        stop.install()
        log.info("local Ray up: %d CPUs, %d GPUs (%s)", num_cpus, num_gpus, "real" if real_gpus else "declared")
        yield "local"
    finally:
        ray.shutdown()
        os.environ.pop(NODE_TMP_ENV, None)
        os.environ.pop(LOOPBACK_ONLY_ENV, None)
        shutil.rmtree(temp_dir, ignore_errors=True)
