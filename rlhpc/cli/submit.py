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
from pathlib import Path
from typing import TYPE_CHECKING

from rlhpc.errors import RlhpcError, StoppedByUser
from rlhpc.logs import setup_logging

if TYPE_CHECKING:
    from rlhpc.launch.submission import Submission

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
    _add_run_options(run)
    _add_sweep_and_followup_options(run)
    slurm = p.add_argument_group(
        "Slurm (spelled as for sbatch; --nodes/--gpus-per-node set cluster.num_nodes/gpus_per_node)"
    )
    _add_sbatch_options(slurm)
    _add_component_options(slurm)
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


def _add_run_options(run: argparse._ArgumentGroup) -> None:
    """The config, the run dir, where it runs and what to do with the job."""
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


def _add_sweep_and_followup_options(run: argparse._ArgumentGroup) -> None:
    """Many runs of one config (a sweep), and jobs that run once training succeeded."""
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
        "--shared-fleet",
        action="store_true",
        help="the sweep's LoRA tasks (actor.lora.push: adapter) run at once on ONE set of engines, each serving "
        "its adapter under its own name (docs/guides/lora.md); local only so far",
    )
    run.add_argument(
        "--then",
        action="append",
        default=[],
        metavar="CMD",
        help="run CMD (bash, with RLHPC_RUN_DIR set) as a job that starts only once training succeeded "
        "(for a sweep: after each task); repeatable",
    )


def _add_sbatch_options(slurm: argparse._ArgumentGroup) -> None:
    """The allocation, spelled as for sbatch."""
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


def _add_component_options(slurm: argparse._ArgumentGroup) -> None:
    """A heterogeneous job's rollout and reward components (cluster.rollout_*, cluster.reward_*)."""
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# The allocation's options, passed on to the config as cluster.<name> overrides.
COMPONENT_OPTIONS = (
    "rollout_nodes", "rollout_gpus_per_node", "rollout_partition",
    "reward_nodes", "reward_gpus_per_node", "reward_partition",
)  # fmt: skip


def submission(args: argparse.Namespace) -> Submission:
    """The parsed command line as what ``rlhpc.launch.submission.submit`` takes."""
    from rlhpc.launch.submission import SbatchArgs, Submission

    overrides = list(args.overrides)
    if args.nodes is not None:
        overrides.append(f"cluster.num_nodes={args.nodes}")
    if args.gpus_per_node is not None:
        overrides.append(f"cluster.gpus_per_node={args.gpus_per_node}")
    overrides += [f"cluster.{o}={getattr(args, o)}" for o in COMPONENT_OPTIONS if getattr(args, o) is not None]
    sbatch = SbatchArgs(
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        time=args.time,
        constraint=args.constraint,
        exclusive=args.exclusive,
        job_name=args.job_name,
        cpus_per_task=args.cpus_per_task,
        signal_grace_s=args.signal_grace,
        extra=tuple(args.sbatch),
    )
    return Submission(
        config=args.config,
        run_dir=args.run_dir or REPO / "runs" / args.config.stem,
        overrides=tuple(overrides),
        kind=args.cluster,
        force=args.force,
        dry_run=args.dry_run,
        prepare_only=args.prepare_only,
        follow=args.follow,
        sweeps=tuple(args.sweep),
        max_parallel=args.max_parallel,
        shared_fleet=args.shared_fleet,
        then=tuple(args.then),
        sbatch=sbatch,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        # Here, not at the top: --help answers without importing the config, Slurm and
        # submitit modules and what they import.
        from rlhpc.launch.submission import submit
        from rlhpc.util.processes import safe_python_env

        safe_python_env()  # the job's processes inherit it: none imports from the working dir
        return submit(submission(args))
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
