#!/usr/bin/env python3
"""Time to a ready Ray cluster on Slurm: polled readiness (rlhpc) vs the public scripts' fixed sleep.

Brings up its own 8-node minicluster (own state dir, subnet and port, so it runs beside the
test cluster), then per N in 1, 2, 4, 8 submits a small sbatch job whose tasks bring Ray up
with ``RayNode`` / ``wait_for_cluster`` in the same order as ``rlhpc.launch.slurm_ray.slurm_ray``.
It prints the seconds from the batch script's first line to "every node and GPU registered",
beside what the fixed-sleep recipes (Ray docs, verl, OpenRLHF: 10 s + 5 s per worker node)
wait for the same N. Tears down the cluster if it started it.

    python tools/bench/ray_ready.py                 # needs root, like tools/minicluster.py
    python tools/bench/ray_ready.py --nodes 1 2 --repeats 3

The last line is one JSON object of ratios, so runs can be compared:

- ``fixed_over_ready_n<N>``: the fixed sleep for N nodes / rlhpc's measured readiness (median);
  above 1, the polled start is ready before a fixed-sleep script would even start its driver.
- ``ready_max_over_min``: readiness at the largest N / at the smallest N (how readiness grows
  with the cluster; on one machine the emulated nodes share its CPUs, so it grows faster here).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

log = logging.getLogger("bench.ray_ready")

STATE_DIR = Path("/tmp/rlhpc-bench-mc")
SUBNET = "10.78.0.0/24"
PORT = 18817  # beside the test clusters (16817, 16900+)
MAX_NODES = 8
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING"}


def fixed_sleep_s(num_nodes: int) -> float:
    """What the fixed-sleep recipes wait before starting the driver: 10 s, then 5 s per worker."""
    return 10.0 + 5.0 * (num_nodes - 1)


# ---------------------------------------------------------------- inside the job (srun task)


def task(out_dir: Path, timeout_s: float) -> int:
    """One srun task: Ray head (task 0) or worker, as rlhpc.launch.slurm_ray.slurm_ray does it."""
    started = time.time()
    from rlhpc.launch.ray_cluster import RayNode, wait_for_cluster
    from rlhpc.launch.slurm_ray import granted_gpus

    rank, num_nodes = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NNODES"])
    # The minicluster's nodes share this machine's /tmp with the test cluster, whose job ids
    # are the same small numbers: a prefix keeps temp dirs (and pgrep patterns) apart. The
    # port block comes from the digits alone, as for a real job.
    job_id = "bench" + os.environ["SLURM_JOB_ID"]
    gpus = granted_gpus()
    cpus = max(int(os.environ.get("SLURM_CPUS_ON_NODE", "0")), os.cpu_count() or 1, 2 * gpus + 2)
    node = RayNode(out_dir / "ray", job_id, rank, gpus, cpus)
    try:
        if rank != 0:
            node.start_worker(timeout_s)
            return node.wait_until_stopped()
        address = node.start_head()
        os.environ.update(node.env())
        import ray

        deadline = time.monotonic() + timeout_s
        while True:  # the GCS needs a moment before it accepts a driver
            try:
                ray.init(address=address, _node_ip_address=node.ip, log_to_driver=True)
                break
            except (ConnectionError, RuntimeError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        connected = time.time()
        wait_for_cluster(node.state, num_nodes, num_nodes * gpus, max(1.0, deadline - time.monotonic()))
        ready = time.time()
        (out_dir / "ready.json").write_text(json.dumps({"task_start": started, "connected": connected, "ready": ready}))
        return 0
    finally:
        if rank == 0:
            node.state.root.mkdir(parents=True, exist_ok=True)
            node.state.stop.write_text("done\n")  # the workers stop their Ray
            if "ray" in sys.modules:
                sys.modules["ray"].shutdown()
        node.stop()


# ---------------------------------------------------------------- the benchmark (login side)


def run_job(env: dict[str, str], work: Path, num_nodes: int, timeout_s: float) -> dict:
    out = work / f"n{num_nodes}-{time.time_ns()}"
    out.mkdir(parents=True)
    script = out / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"date +%s.%N > {out}/job_start\n"
        f"srun --ntasks-per-node=1 {sys.executable} {Path(__file__).resolve()} --task {out} --timeout {timeout_s}\n"
    )
    sub = subprocess.run(
        ["sbatch", "--parsable", f"--nodes={num_nodes}", "--ntasks-per-node=1", "--gpus-per-node=1",
         "--time=10", f"--output={out}/slurm-%j.out", str(script)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    job_id = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout_s + 60
    while True:
        state = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env)
        fields = dict(f.split("=", 1) for f in state.stdout.split() if "=" in f)
        if fields.get("JobState") not in ACTIVE:
            break
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=env)
            raise RuntimeError(f"job {job_id} ({num_nodes} nodes) did not end in time; see {out}")
        time.sleep(0.5)
    if not (out / "ready.json").is_file():
        raise RuntimeError(
            f"job {job_id} ({num_nodes} nodes) ended {fields.get('JobState')} without a ready cluster; see {out}"
        )
    ready = json.loads((out / "ready.json").read_text())
    job_start = float((out / "job_start").read_text())
    left = subprocess.run(["pgrep", "-f", f"rlhpc-bench{job_id}-"], capture_output=True, text=True).stdout.split()
    for rank in range(num_nodes):  # Ray's node-local temp dirs (RayNode leaves them, as in a real job)
        shutil.rmtree(Path("/tmp") / f"rlhpc-bench{job_id}-{rank}", ignore_errors=True)
    return {
        "job_id": job_id,
        "measured": ready["ready"] - job_start,
        "connected": ready["connected"] - job_start,
        "left_pids": left,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8], help="cluster sizes (at most 8)")
    p.add_argument("--repeats", type=int, default=1, help="jobs per size; the median is shown")
    p.add_argument("--timeout", type=float, default=300.0, help="readiness deadline per job (seconds)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/rlhpc-bench-ray-ready"))
    p.add_argument("--keep", action="store_true", help="leave the minicluster up (tools/minicluster.py down)")
    p.add_argument("--task", type=Path, help=argparse.SUPPRESS)  # inside the job: one srun task
    args = p.parse_args(argv)
    if args.task:
        return task(args.task, args.timeout)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if max(args.nodes) > MAX_NODES or min(args.nodes) < 1:
        p.error(f"--nodes must lie in 1..{MAX_NODES}")

    from rlhpc.devtools.minicluster import MiniCluster

    mc = MiniCluster(STATE_DIR, nodes=MAX_NODES, gpus_per_node=1, subnet=SUBNET, port=PORT)
    started = mc.up()
    log.info("minicluster %s in %s (%d nodes x 1 GPU)", "started" if started else "reused", STATE_DIR, MAX_NODES)
    env = {**os.environ, "SLURM_CONF": str(mc.slurm_conf), "PYTHONPATH": str(REPO)}
    rows = []
    try:
        for n in args.nodes:
            runs = []
            for _ in range(args.repeats):
                r = run_job(env, args.work_dir, n, args.timeout)
                log.info("%d node(s): job %s ready %.1fs after its start", n, r["job_id"], r["measured"])
                if r["left_pids"]:
                    log.warning("job %s left processes behind: %s", r["job_id"], " ".join(r["left_pids"]))
                runs.append(r)
            rows.append((n, *(statistics.median(r[k] for r in runs) for k in ("measured", "connected"))))
    finally:
        if not args.keep:
            shutil.rmtree(args.work_dir, ignore_errors=True)
            if started:
                mc.down()
    print(
        f"\nRay time-to-ready on the minicluster ({os.cpu_count()} CPUs shared by all nodes), median of {args.repeats}"
    )
    print(f"{'nodes':>5} {'ready s':>8} {'(head up s)':>11} {'fixed sleep s':>14} {'fixed/ready':>12}")
    for n, measured, connected in rows:
        fixed = fixed_sleep_s(n)
        print(f"{n:>5} {measured:>8.1f} {connected:>11.1f} {fixed:>14.1f} {fixed / measured:>12.2f}")
    print("ready: from the batch script's first line until every node and GPU registered (polled);")
    print("head up: until the driver connected to the head; fixed sleep: 10 s + 5 s per worker node.")
    print(f"All emulated nodes start their Ray on the same {os.cpu_count()} CPUs; real nodes each use their own.")
    print(json.dumps(ratios(rows)))
    return 0


def ratios(rows: list[tuple[int, float, float]]) -> dict[str, float]:
    """The JSON line: fixed sleep / readiness per size, and how readiness grows (module docstring)."""
    out = {f"fixed_over_ready_n{n}": round(fixed_sleep_s(n) / measured, 3) for n, measured, _ in rows}
    by_size = sorted(rows)
    out["ready_max_over_min"] = round(by_size[-1][1] / by_size[0][1], 3)
    return out


if __name__ == "__main__":
    sys.exit(main())
