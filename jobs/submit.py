#!/usr/bin/env python3
"""Submit an rlhpc training run.

    python jobs/submit.py                                  # the embedded default: local, tiny model
    python jobs/submit.py --config my.yaml --set rollout.num_rollout=50
    python jobs/submit.py --run-dir runs/exp1              # rerun the same command to resume

Everything is validated before anything is submitted; errors name the problem and the fix.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from rlhpc.config import load_config  # noqa: E402
from rlhpc.errors import RlhpcError  # noqa: E402
from rlhpc.logs import FORCE_TERMINAL_ENV, setup_logging  # noqa: E402
from rlhpc.run_dir import RunDir  # noqa: E402

DEFAULT_CONFIG = REPO / "jobs" / "configs" / "embedded.yaml"
log = logging.getLogger("rlhpc.submit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Run RL post-training as a batch job (Slurm when available, else locally).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help=f"YAML config (default: {DEFAULT_CONFIG.relative_to(REPO)})"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set rollout.num_rollout=20 (repeatable)",
    )
    p.add_argument(
        "--run-dir", type=Path, help="where config, checkpoints, logs and metrics go (default: runs/<config name>)"
    )
    p.add_argument(
        "--cluster",
        choices=("auto", "local", "slurm"),
        default="auto",
        help="auto: Slurm if `sinfo` answers, else local",
    )
    p.add_argument("--time", type=int, default=24 * 60, metavar="MINUTES", help="time limit of the job (default: 1440)")
    p.add_argument("--force", action="store_true", help="resume a run dir whose config differs from this one")
    p.add_argument(
        "--no-follow",
        dest="follow",
        action="store_false",
        help="return once submitted instead of streaming the job's output",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        from rlhpc.launch.submit import choose_cluster, submit_local

        cfg = load_config(args.config, args.overrides)
        cluster = choose_cluster(args.cluster)
        if cluster == "slurm":
            raise RlhpcError("Slurm submission is not available in this version", "use --cluster local")
        run = RunDir(args.run_dir or REPO / "runs" / args.config.stem)
        run.prepare(cfg, force=args.force)
        if args.follow and sys.stdout.isatty():
            os.environ[FORCE_TERMINAL_ENV] = "1"  # the job writes to a file we stream to this terminal
        import torch

        return submit_local(run, args.time, torch.cuda.device_count(), wait=args.follow)
    except RlhpcError as e:
        log.error("%s", e)
        return 2
    except KeyboardInterrupt:
        log.warning("interrupted; run the same command again to resume from the last checkpoint")
        return 130


if __name__ == "__main__":
    sys.exit(main())
