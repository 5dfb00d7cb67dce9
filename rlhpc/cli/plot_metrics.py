"""Plot a run's metrics.jsonl to a PNG: train and eval reward, response length, entropy, loss, KL, step time.

python tools/plot_metrics.py runs/embedded            # writes runs/embedded/metrics.png
python tools/plot_metrics.py runs/sweep1              # a sweep dir: its tasks overlaid, runs/sweep1/metrics.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhpc.errors import RlhpcError
from rlhpc.metric_names import eval_means, eval_name
from rlhpc.metrics import read_metrics
from rlhpc.run_dir import RunDir, SweepDir


def plot(run: RunDir, out: Path) -> Path:
    figure(run).savefig(out, dpi=100)
    return out


def figure(run: RunDir):
    """The run's panels: reward (train and eval), response length, entropy, loss, KL, step time."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a login node
    import matplotlib.pyplot as plt

    records = read_metrics(run)
    if not records:
        raise RlhpcError(
            f"{run.metrics_file} is missing or empty", "point at a run dir that has trained at least one rollout"
        )
    train = [r for r in records if r["kind"] == "rollout"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    ax = axes[0][0]
    ax.plot(
        [r["rollout_id"] + 1 for r in train], [r["reward"] for r in train], lw=0.8, alpha=0.6, label="reward (train)"
    )
    for name in dict.fromkeys(n for r in evals for n in eval_means(r)):  # one line per eval set, by its metric's name
        points = [(r["rollout_id"] + 1, eval_means(r)[name]) for r in evals if name in eval_means(r)]
        ax.plot(*zip(*points), "o-", label=eval_name(None, "reward") if name == "eval" else eval_name(name, "reward"))
    ax.set(title="reward", xlabel="rollouts trained", ylim=(-0.02, 1.02))
    ax.legend()
    for ax, key, title in (
        (axes[0][1], "response_len", "response length (tokens)"),
        (axes[0][2], "entropy", "nats per token: a collapse shows here first"),
        (axes[1][0], "loss", "policy loss"),
        (axes[1][1], "kl", "to the reference (algo.kl_estimator; 0 when algo.kl_coef = 0)"),
        (axes[1][2], "time/step", "seconds per rollout"),
    ):
        pts = [(r["rollout_id"] + 1, r[key]) for r in train if key in r]
        ax.plot([x for x, _ in pts], [y for _, y in pts], lw=0.8)
        ax.set(title=f"{key}: {title}", xlabel="rollouts trained")  # the metric's name, as everywhere
    fig.suptitle(f"rlhpc run {run.path.name}")
    fig.tight_layout()
    return fig


def plot_sweep(sweep: SweepDir, out: Path) -> Path:
    """The tasks of a sweep overlaid: train and eval reward, one line per task (its overrides)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [(i, ", ".join(o), read_metrics(sweep.task(i))) for i, o in enumerate(sweep.read_spec() or [])]
    if not any(records for _, _, records in tasks):
        raise RlhpcError(f"no task of sweep {sweep.path} has metrics yet", "wait until a task trained a rollout")
    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, label, records in tasks:
        train = [r for r in records if r["kind"] == "rollout"]
        evals = [r for r in records if r["kind"] == "eval"]
        color = f"C{i % 10}"
        train_ax.plot(
            [r["rollout_id"] + 1 for r in train],
            [r["reward"] for r in train],
            lw=0.8,
            color=color,
            label=f"{i}: {label}",
        )
        firsts = [(r["rollout_id"] + 1, next(iter(eval_means(r).values()))) for r in evals if eval_means(r)]
        if firsts:  # the first eval set of each task
            eval_ax.plot(*zip(*firsts), "o-", color=color, label=f"{i}: {label}")
    train_ax.set(title="reward (train, sampled)", xlabel="rollouts trained", ylim=(-0.02, 1.02))
    eval_ax.set(title="eval/reward or the first set's eval/NAME/mean", xlabel="rollouts trained", ylim=(-0.02, 1.02))
    train_ax.legend(fontsize="small")
    fig.suptitle(f"rlhpc sweep {sweep.path.name}: {len(tasks)} tasks")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


def build_parser() -> argparse.ArgumentParser:
    """This command's options; the docs test checks the commands the docs show against it."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("-o", "--out", type=Path, help="PNG path (default: RUN_DIR/metrics.png)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        if SweepDir.is_sweep(args.run_dir):
            sweep = SweepDir(args.run_dir)
            print(plot_sweep(sweep, args.out or sweep.metrics_plot))
            return 0
        run = RunDir(args.run_dir)
        print(plot(run, args.out or run.metrics_plot))
    except RlhpcError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
