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
from rlhpc.util.files import NODE_TMP_ENV, ray_temp_dir, remove_if_ours, write_atomic
from rlhpc.util.processes import ray_job_config, safe_python_env
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
    record: Path | None = None,
):
    """A private single-node Ray: its own temp dir, no dashboard, GPUs declared if none exist.

    ``stop`` starts listening once Ray's processes exist (they keep USR2 ignored).
    Token authentication always, as on Slurm, with a new random token in a 0600 file:
    ``token_file`` (``JobRayState.token``), else one in the temp dir; set before ray is first
    imported, which reads RAY_AUTH_* then. The temp dir is a new one under a name nobody can
    tell in advance (another user could make a predictable one first and block the run);
    ``record`` (``RunDir.local_ray_dir_file``) keeps its path, so that the next start removes
    what a killed one left (only a dir of ours, never through a link)."""
    if record is not None and (old := _recorded(record)) is not None and remove_if_ours(old):
        log.info("removed %s, left by a killed job of this run", old)
    temp_dir = Path(tempfile.mkdtemp(prefix="rlhpc-ray-"))  # 0700, ours, a random name
    try:
        if record is not None:
            record.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(record, str(temp_dir))
        token_file = token_file or temp_dir / "ray_token"
        write_secret(token_file)
        os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)})
        # Every listener of a one-node Ray on loopback (issue 32, item 12): its node address is then
        # 127.0.0.1 (what Ray does on macOS), and its gRPC servers (GCS, raylet, workers, the
        # dashboard's and its agents) bind there, not on all addresses; ray.init(_node_ip_address=
        # "127.0.0.1") is turned back into the node's IP. Read when ray is first imported.
        os.environ[LOOPBACK_ONLY_ENV] = "0"
        os.environ.update(METRICS_ENV)
        os.environ.update(NO_PRESTART_ENV)
        safe_python_env()  # Ray's processes and workers inherit it
        os.environ[NODE_TMP_ENV] = str(temp_dir)  # Ray's workers inherit it: engines' files go with the dir
        with _ray(cluster, slots, stop, temp_dir):
            yield "local"
    finally:
        os.environ.pop(NODE_TMP_ENV, None)
        os.environ.pop(LOOPBACK_ONLY_ENV, None)
        shutil.rmtree(temp_dir, ignore_errors=True)


# Ray's Prometheus endpoints answer whoever reaches them, without the token (issue 43, item 12):
# the agent's per-node exporter is off (Ray's switch; rlhpc keeps its own metrics), and the
# dashboard's and autoscaler's, which Ray has no switch for, get a port the kernel picks, not
# their fixed defaults (44227, 44217), which two jobs on one node would share.
METRICS_ENV = {"RAY_enable_metrics_collection": "0", "DASHBOARD_METRIC_PORT": "0", "AUTOSCALER_METRIC_PORT": "0"}


# Ray starts idle Python workers when the first driver connects; a job's ranks and engines are
# actors with workers of their own and the placement probes need none, so none of them is used:
# each costs a second of CPU at every start (measured: docs/development.md, "where CI time goes").
NO_PRESTART_ENV = {"RAY_prestart_worker_first_driver": "0"}


def _recorded(record: Path) -> Path | None:
    try:
        return Path(record.read_text().strip())
    except FileNotFoundError:
        return None


@contextmanager
def _ray(cluster: ClusterConfig, slots: int, stop: StopRequest, temp_dir: Path):
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
    try:
        ray.init(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            _temp_dir=str(ray_temp_dir(temp_dir)),
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
            log_to_driver=True,
            job_config=ray_job_config(),  # the driver's working dir on no worker's sys.path
        )
        stop.install()
        log.info("local Ray up: %d CPUs, %d GPUs (%s)", num_cpus, num_gpus, "real" if real_gpus else "declared")
        yield
    finally:
        ray.shutdown()
