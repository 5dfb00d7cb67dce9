#!/usr/bin/env python3
"""Print one rollout dump (RUN_DIR/rollouts/rollout_NNNNNN.h5): prompts, responses, rewards.

python tools/show_rollout.py runs/embedded 42          # rollout id 42
python tools/show_rollout.py runs/embedded/rollouts/rollout_000042.h5 --limit 16
"""

import argparse
import sys
from pathlib import Path

import h5py


def find(path: Path, rollout_id: int | None) -> Path:
    if path.is_file():
        return path
    dumps = sorted((path / "rollouts").glob("rollout_*.h5"))
    if not dumps:
        raise SystemExit(f"error: no rollout dumps under {path}/rollouts\n  fix: run with logging.dump_rollouts: true")
    if rollout_id is None:
        return dumps[-1]
    f = path / "rollouts" / f"rollout_{rollout_id:06d}.h5"
    if not f.is_file():
        raise SystemExit(f"error: {f} does not exist\n  fix: pick one of {dumps[0].stem}..{dumps[-1].stem}")
    return f


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, help="a run dir or an .h5 dump")
    p.add_argument("rollout_id", type=int, nargs="?", help="default: the newest dump")
    p.add_argument("--limit", type=int, default=24, help="samples to print")
    args = p.parse_args()
    f = find(args.path, args.rollout_id)
    with h5py.File(f) as h:
        rewards, adv = h["rewards"][:], h["advantages"][:]
        print(
            f"{f}: rollout {h.attrs['rollout_id']}, {len(rewards)} samples, group size {h.attrs['group_size']}, mean reward {rewards.mean():.3f}"
        )
        print(f"{'prompt':<14} {'response':<14} {'answer':<8} {'reward':>6} {'adv':>7}")
        for i in range(min(args.limit, len(rewards))):
            prompt, resp, ans = (h[k][i].decode() for k in ("prompt", "response", "answer"))
            print(f"{prompt!r:<14} {resp!r:<14} {ans!r:<8} {rewards[i]:>6.2f} {adv[i]:>+7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
