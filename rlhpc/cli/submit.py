"""Submit an rlhpc training run: to Slurm when it answers, else on this machine.

    python jobs/submit.py                                  # the embedded default (local, tiny model)
    python jobs/submit.py --nodes 8 --gpus-per-node 8 --partition gpu --time 24:00:00 --config my.yaml
    python jobs/submit.py --nodes 2 --dry-run              # print the sbatch script and GPU plan
    python jobs/submit.py --run-dir runs/exp1              # the same command again resumes exp1

Everything is validated before anything is submitted; errors name the problem and the fix.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from rlhpc.errors import RlhpcError
from rlhpc.logs import FORCE_TERMINAL_ENV, setup_logging

REPO = Path(__file__).resolve().parents[2]  # the checkout rlhpc is installed from (editable)

DEFAULT_CONFIG = REPO / "jobs" / "configs" / "embedded.yaml"
log = logging.getLogger("rlhpc.submit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Run RL post-training as a batch job (Slurm when available, else locally).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    run = p.add_argument_group("run")
    run.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help=f"YAML config (default: {DEFAULT_CONFIG.relative_to(REPO)})"
    )
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set rollout.num_rollout=20 (repeatable)",
    )
    run.add_argument(
        "--run-dir",
        type=Path,
        help="where config, checkpoints, logs and metrics go (default: runs/<config name>); must be on a filesystem every node sees",
    )
    run.add_argument(
        "--cluster",
        choices=("auto", "local", "slurm"),
        default="auto",
        help="auto: Slurm if `sinfo` answers, else local",
    )
    run.add_argument("--force", action="store_true", help="resume a run dir whose config differs from this one")
    run.add_argument("--dry-run", action="store_true", help="print the sbatch script and GPU plan; submit nothing")
    run.add_argument(
        "--prepare-only",
        action="store_true",
        help="validate and prepare the run dir, submit nothing (for slurm_templates/)",
    )
    run.add_argument(
        "--follow",
        dest="follow",
        action="store_true",
        default=None,
        help="stream the job's output until it ends (default for local runs)",
    )
    run.add_argument("--no-follow", dest="follow", action="store_false", help="return once submitted")
    slurm = p.add_argument_group(
        "Slurm (spelled as for sbatch; --nodes/--gpus-per-node set cluster.num_nodes/gpus_per_node)"
    )
    slurm.add_argument("--nodes", "-N", type=int, help="nodes (default: cluster.num_nodes)")
    slurm.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: cluster.gpus_per_node)")
    slurm.add_argument("--partition", "-p")
    slurm.add_argument("--account", "-A")
    slurm.add_argument("--qos", "-q")
    slurm.add_argument(
        "--time", "-t", default="24:00:00", help="time limit: minutes, HH:MM:SS or D-HH:MM (default: 24:00:00)"
    )
    slurm.add_argument("--constraint", "-C")
    slurm.add_argument("--exclusive", action="store_true")
    slurm.add_argument("--job-name", "-J", default="rlhpc")
    slurm.add_argument("--cpus-per-task", "-c", type=int)
    slurm.add_argument(
        "--signal-grace",
        type=int,
        default=120,
        metavar="SECONDS",
        help="warn the job this long before its time limit (default: 120)",
    )
    slurm.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION[=VALUE]",
        help="any other sbatch option, e.g. --sbatch mail-type=END (repeatable)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        from rlhpc.config import load_config
        from rlhpc.launch import run_owner
        from rlhpc.launch.run_owner import Owner
        from rlhpc.launch.slurm import SlurmOptions, parse_extra, parse_time, preflight
        from rlhpc.launch.submit import choose_cluster, dry_run, follow, start_local, start_slurm, submit_owned
        from rlhpc.run_dir import RunDir

        overrides = list(args.overrides)
        if args.nodes is not None:
            overrides.append(f"cluster.num_nodes={args.nodes}")
        if args.gpus_per_node is not None:
            overrides.append(f"cluster.gpus_per_node={args.gpus_per_node}")
        cfg = load_config(args.config, overrides)
        time_min = parse_time(args.time)
        run_dir = args.run_dir or REPO / "runs" / args.config.stem
        opts = SlurmOptions(
            nodes=cfg.cluster.num_nodes,
            gpus_per_node=cfg.cluster.gpus_per_node,
            partition=args.partition,
            account=args.account,
            qos=args.qos,
            time_min=time_min,
            constraint=args.constraint,
            exclusive=args.exclusive,
            job_name=args.job_name,
            cpus_per_task=args.cpus_per_task,
            signal_grace_s=args.signal_grace,
            extra=parse_extra(args.sbatch),
        )
        opts.check()
        if args.dry_run:
            print(dry_run(cfg, Path(run_dir).resolve(), opts), end="")
            return 0
        cluster = choose_cluster(args.cluster)
        if cluster == "slurm":
            if not args.prepare_only:  # inside an allocation (templates) there is nothing to check
                preflight(opts)
        elif cfg.cluster.num_nodes != 1:
            raise RlhpcError(
                f"a local run has one node, but cluster.num_nodes = {cfg.cluster.num_nodes}",
                "submit to Slurm, or set --nodes 1",
            )
        run = RunDir(run_dir)
        run.check(cfg, force=args.force)  # every refusal before anything is written
        # Inside an allocation (a template's --prepare-only) this job may own the run dir already.
        in_job = os.environ.get("SLURM_JOB_ID")
        run_owner.check_free(run, Owner.slurm_job(in_job) if in_job else None)
        if args.prepare_only:  # the job claims the run dir when it starts
            run.prepare(cfg, force=args.force)
            log.info("run dir %s is ready; start every task with: srun python -m rlhpc.launch.task %s", run, run)
            return 0
        if cluster == "slurm":

            def start():
                run.prepare(cfg, force=args.force)
                return start_slurm(run, opts)

            job = submit_owned(run, start, lambda j: Owner.slurm_job(j.job_id))
            return follow(job) if args.follow else 0
        if args.follow is not False and sys.stdout.isatty():
            os.environ[FORCE_TERMINAL_ENV] = "1"  # the job writes to a file we stream to this terminal
        import torch

        def start():
            run.prepare(cfg, force=args.force)
            return start_local(run, time_min, torch.cuda.device_count(), cfg.checkpoint.max_restarts)

        job = submit_owned(run, start, lambda j: Owner.local_job(int(j.job_id)))
        if args.follow is False:
            log.info("follow it with: tail -f %s", job.paths.stdout)
            return 0
        return follow(job)
    except RlhpcError as e:
        log.error("%s", e)
        return 2
    except KeyboardInterrupt:
        log.warning("interrupted; run the same command again to resume from the last checkpoint")
        return 130
