"""Submit an rlhpc training run: to Slurm when it answers, else on this machine.

    python jobs/submit.py                                  # the embedded default (local, tiny model)
    python jobs/submit.py --nodes 8 --gpus-per-node 8 --partition gpu --time 24:00:00 --config my.yaml
    python jobs/submit.py --nodes 2 --dry-run              # print the sbatch script and GPU plan
    python jobs/submit.py --run-dir runs/exp1              # the same command again resumes exp1
    python jobs/submit.py --run-dir runs/lr --sweep actor.lr=1e-4,3e-4 --sweep seed=1,2 --max-parallel 2
    python jobs/submit.py --then 'python my_eval.py "$RLHPC_RUN_DIR"'       # a job that runs once training succeeded
    python jobs/submit.py --nodes 1 --gpus-per-node 4 --partition train \
        --rollout-nodes 2 --rollout-gpus-per-node 2 --rollout-partition gen    # a heterogeneous job
    python jobs/submit.py --nodes 1 --partition train --rollout-nodes 2 --rollout-partition gen \
        --reward-nodes 1 --reward-partition score --config rm.yaml             # + the reward model's component

Everything is validated before anything is submitted; errors name the problem and the fix.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from rlhpc.errors import RlhpcError, StoppedByUser
from rlhpc.logs import FORCE_TERMINAL_ENV, setup_logging

REPO = Path(__file__).resolve().parents[2]  # the checkout rlhpc is installed from (editable)

DEFAULT_CONFIG = REPO / "jobs" / "configs" / "embedded.yaml"
log = logging.getLogger("rlhpc.submit")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``jobs/submit.py``; the docs test checks the commands it shows against it."""
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
    run.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="run one task per combination of these values (repeatable: the Cartesian product), as ONE Slurm "
        "job array; task i gets the run dir RUN_DIR/task_00i",
    )
    run.add_argument("--max-parallel", type=int, metavar="P", help="sweep tasks running at once (default: all)")
    run.add_argument(
        "--then",
        action="append",
        default=[],
        metavar="CMD",
        help="run CMD (bash, with RLHPC_RUN_DIR set) as a job that starts only once training succeeded "
        "(for a sweep: after each task); repeatable",
    )
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
        "--rollout-nodes",
        type=int,
        help="a heterogeneous job: the engines on this many nodes of their own (cluster.rollout_nodes), "
        "the actor on --nodes",
    )
    slurm.add_argument(
        "--rollout-gpus-per-node", type=int, help="GPUs per rollout node (cluster.rollout_gpus_per_node)"
    )
    slurm.add_argument(
        "--rollout-partition", help="the rollout nodes' partition (cluster.rollout_partition; default --partition)"
    )
    slurm.add_argument(
        "--reward-nodes",
        type=int,
        help="a heterogeneous job's third component: the reward engines on this many nodes of their own "
        "(cluster.reward_nodes; needs --rollout-nodes and a reward_model section)",
    )
    slurm.add_argument("--reward-gpus-per-node", type=int, help="GPUs per reward node (cluster.reward_gpus_per_node)")
    slurm.add_argument(
        "--reward-partition", help="the reward nodes' partition (cluster.reward_partition; default --partition)"
    )
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
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        from rlhpc.cluster.layout import idle_note
        from rlhpc.launch import run_owner
        from rlhpc.launch.followup import run_now, submit_after
        from rlhpc.launch.run_owner import Owner
        from rlhpc.launch.slurm import SlurmOptions, parse_extra, parse_time, preflight
        from rlhpc.launch.submit import choose_cluster, dry_run, follow, start_local, start_slurm, submit_owned
        from rlhpc.launch.sweep import parse_sweeps
        from rlhpc.preflight import load_config
        from rlhpc.run_dir import RunDir

        overrides = list(args.overrides)
        if args.nodes is not None:
            overrides.append(f"cluster.num_nodes={args.nodes}")
        if args.gpus_per_node is not None:
            overrides.append(f"cluster.gpus_per_node={args.gpus_per_node}")
        for option in (
            "rollout_nodes", "rollout_gpus_per_node", "rollout_partition",
            "reward_nodes", "reward_gpus_per_node", "reward_partition",
        ):  # fmt: skip
            if getattr(args, option) is not None:
                overrides.append(f"cluster.{option}={getattr(args, option)}")
        sweeps = parse_sweeps(args.sweep)
        _check_sweep_and_then(args, sweeps)
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
            rollout_nodes=cfg.cluster.rollout_nodes,
            rollout_gpus_per_node=cfg.cluster.rollout_gpus_per_node,
            rollout_partition=cfg.cluster.rollout_partition,
            reward_nodes=cfg.cluster.reward_nodes,
            reward_gpus_per_node=cfg.cluster.reward_gpus_per_node,
            reward_partition=cfg.cluster.reward_partition,
        )
        opts.check()
        idle = idle_note(cfg.cluster, cfg.reward_model, cfg.teacher)
        if idle and not args.dry_run:  # the dry run prints it with the plan
            log.warning("%s", idle)
        if sweeps:
            return _sweep(args, overrides, sweeps, opts, Path(run_dir))
        if args.dry_run:  # the run dir's checks too: a preview of a submission that would be refused is none
            RunDir(run_dir).check(cfg, force=args.force)
            run_owner.check_free(RunDir(run_dir))
            print(dry_run(cfg, Path(run_dir).resolve(), opts), end="")
            return 0
        cluster = choose_cluster(args.cluster)
        if cluster == "slurm":
            if not args.prepare_only:  # inside an allocation (templates) there is nothing to check
                preflight(opts)
        elif cfg.cluster.num_nodes != 1 or cfg.cluster.heterogeneous:
            raise RlhpcError(
                f"a local run has one node, but cluster.num_nodes = {cfg.cluster.num_nodes}"
                + (f" and cluster.rollout_nodes = {cfg.cluster.rollout_nodes}" if cfg.cluster.heterogeneous else ""),
                "submit to Slurm, or set --nodes 1 (and no --rollout-nodes)",
            )
        if cluster == "local" and args.then and args.follow is False:
            raise RlhpcError(
                "--then with --no-follow on a local run", "drop --no-follow: the follow-ups run when it ends"
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
            submit_after(run, job.job_id, args.then, opts)
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
        code = follow(job)
        run_now(run, args.then)
        return code
    except StoppedByUser as e:
        log.warning("%s", e)
        return 130
    except RlhpcError as e:
        log.error("%s", e)
        return 2
    except KeyboardInterrupt:
        log.warning(
            "interrupted: a job already submitted goes on (Slurm) or stops at its next safe point (local); "
            "`rlhpc-status RUN_DIR` shows where it stands, and the same command resumes it once it has stopped"
        )
        return 130


def _check_sweep_and_then(args: argparse.Namespace, sweeps: list) -> None:
    """Options that do not go together, refused before anything is read or written."""
    from rlhpc.errors import ConfigError

    if args.max_parallel is not None and not sweeps:
        raise ConfigError("--max-parallel without --sweep", "add --sweep KEY=V1,V2,... or drop --max-parallel")
    if args.max_parallel is not None and args.max_parallel < 1:
        raise ConfigError(f"--max-parallel {args.max_parallel} must be at least 1", "give the tasks to run at once")
    allocation = (
        "cluster.num_nodes",
        "cluster.gpus_per_node",
        "cluster.rollout_nodes",
        "cluster.rollout_gpus_per_node",
        "cluster.reward_nodes",
        "cluster.reward_gpus_per_node",
    )
    shape = [k for k, _ in sweeps if k in allocation]
    if shape:
        raise ConfigError(
            f"--sweep {shape[0]}: the tasks of a job array share one allocation shape",
            "submit one sweep per --nodes/--gpus-per-node",
        )
    if args.prepare_only and (sweeps or args.then):
        raise ConfigError(
            "--prepare-only prepares one run dir for a template", "drop --sweep/--then, or submit without it"
        )
    if any(not c.strip() for c in args.then):
        raise ConfigError("--then with an empty command", 'write e.g. --then "python my_eval.py"')


def _sweep(args: argparse.Namespace, overrides: list[str], sweeps: list, opts, sweep_path: Path) -> int:
    """``--sweep``: every task checked, then ONE job array (Slurm) or the tasks in turn (local)."""
    import sys

    from rlhpc.launch.followup import run_now, submit_after
    from rlhpc.launch.run_owner import Owner
    from rlhpc.launch.slurm import preflight
    from rlhpc.launch.submit import choose_cluster, dry_run, follow, start_local, submit_owned
    from rlhpc.launch.sweep import plan_sweep, run_locally, submit_array
    from rlhpc.run_dir import SweepDir

    if opts.rollout_nodes is not None:
        raise RlhpcError(
            "--sweep with --rollout-nodes: a sweep is one Slurm job array, and Slurm has no arrays of "
            "heterogeneous jobs",
            "submit each configuration as a job of its own, or sweep without --rollout-nodes",
        )
    sweep = SweepDir(sweep_path)
    tasks = plan_sweep(args.config, overrides, sweeps, sweep, args.force)
    if args.dry_run:
        print(dry_run(tasks[0].cfg, sweep.path, opts, array=len(tasks), max_parallel=args.max_parallel), end="")
        for t in tasks:
            print(f"  task {t.index}: {t.describe()} -> {t.run}")
        return 0
    cluster = choose_cluster(args.cluster)
    if cluster == "slurm":
        preflight(opts)
        submitted = submit_array(sweep, tasks, opts, args.max_parallel, args.force)
        for t, job in submitted:
            submit_after(t.run, job.job_id, args.then, opts)
        return 0
    if opts.nodes != 1:
        raise RlhpcError(
            f"a local run has one node, but cluster.num_nodes = {opts.nodes}", "submit to Slurm, or set --nodes 1"
        )
    if args.follow is not False and sys.stdout.isatty():
        os.environ[FORCE_TERMINAL_ENV] = "1"
    import torch

    def run_one(t):
        def start():
            t.run.prepare(t.cfg, force=args.force)
            return start_local(t.run, opts.time_min, torch.cuda.device_count(), t.cfg.checkpoint.max_restarts)

        return submit_owned(t.run, start, lambda j: Owner.local_job(int(j.job_id)))

    def follow_then(t, job) -> int:
        code = follow(job)
        run_now(t.run, args.then)
        return code

    failed = run_locally(sweep, tasks, run_one, follow_then)
    if failed:
        raise RlhpcError(
            f"{len(failed)} of {len(tasks)} sweep task(s) failed: "
            + "; ".join(f"task {t.index} ({t.describe()}): {why}" for t, why in failed),
            f"see each task's log under its run dir; run the same command again to resume them ({sweep})",
        )
    return 0
