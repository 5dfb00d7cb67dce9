#!/usr/bin/env python3
"""Plot a run's metrics.jsonl to a PNG: train and eval reward, response length, loss, step time.

python tools/plot_metrics.py runs/embedded            # writes runs/embedded/metrics.png
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # no display on a login node
import matplotlib.pyplot as plt  # noqa: E402

from rlhpc.metrics import read_metrics  # noqa: E402


def plot(run_dir: Path, out: Path) -> Path:
    records = read_metrics(run_dir)
    if not records:
        raise SystemExit(
            f"error: {run_dir}/metrics.jsonl is missing or empty\n  fix: point at a run dir that has trained at least one rollout"
        )
    train = [r for r in records if r["kind"] == "rollout"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.plot(
        [r["rollout_id"] + 1 for r in train], [r["reward"] for r in train], lw=0.8, alpha=0.6, label="train (sampled)"
    )
    ax.plot([r["rollout_id"] + 1 for r in evals], [r["reward"] for r in evals], "o-", label="eval (greedy)")
    ax.set(title="reward", xlabel="rollouts trained", ylim=(-0.02, 1.02))
    ax.legend()
    for ax, key, title in (
        (axes[0][1], "response_len", "response length (tokens)"),
        (axes[1][0], "loss", "policy loss"),
        (axes[1][1], "time/step", "seconds per rollout"),
    ):
        pts = [(r["rollout_id"] + 1, r[key]) for r in train if key in r]
        ax.plot([x for x, _ in pts], [y for _, y in pts], lw=0.8)
        ax.set(title=title, xlabel="rollouts trained")
    fig.suptitle(f"rlhpc run {run_dir.name}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("-o", "--out", type=Path, help="PNG path (default: RUN_DIR/metrics.png)")
    args = p.parse_args()
    print(plot(args.run_dir, args.out or args.run_dir / "metrics.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
