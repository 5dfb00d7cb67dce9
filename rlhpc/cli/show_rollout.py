"""Print one rollout dump (RUN_DIR/rollouts/rollout_NNNNNN.h5): prompts, responses, rewards.

python tools/show_rollout.py runs/embedded 42          # rollout id 42
python tools/show_rollout.py runs/embedded/rollouts/rollout_000042.h5 --limit 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhpc.errors import RlhpcError
from rlhpc.metrics import open_rollout_dump, printable
from rlhpc.run_dir import RunDir


def find(path: Path, rollout_id: int | None) -> Path:
    """``path`` itself if it is a dump, else the run dir's dump of ``rollout_id`` (default: the newest)."""
    if path.is_file():
        return path
    run = RunDir(path)
    dumps = run.rollout_dumps()
    if not dumps:
        raise RlhpcError(f"no rollout dumps under {run.rollouts_dir}", "run with logging.dump_rollouts: true")
    if rollout_id is None:
        return dumps[-1]
    f = run.rollout_dump(rollout_id)
    if not f.is_file():
        raise RlhpcError(f"{f} does not exist", f"pick one of {dumps[0].stem}..{dumps[-1].stem}")
    return f


def build_parser() -> argparse.ArgumentParser:
    """This command's options; the docs test checks the commands the docs show against it."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, help="a run dir or an .h5 dump")
    p.add_argument("rollout_id", type=int, nargs="?", help="default: the newest dump")
    p.add_argument("--limit", type=int, default=24, help="samples to print")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        f = find(args.path, args.rollout_id)
        return show(f, args.limit)
    except RlhpcError as e:
        print("error: " + "\n".join(printable(line) for line in str(e).splitlines()), file=sys.stderr)
        return 1


def show(f: Path, limit: int) -> int:
    # the dump may come from anyone: checked as it opens, every text of it printed escaped
    with open_rollout_dump(f) as h:
        rewards, adv = h["rewards"][:], h["advantages"][:]
        rollout_id, group_size = printable(h.attrs["rollout_id"]), printable(h.attrs["group_size"])
        print(
            f"{printable(f)}: rollout {rollout_id}, {len(rewards)} samples, group size {group_size}, mean reward {rewards.mean():.3f}"
        )
        print(f"{'prompt':<14} {'response':<14} {'answer':<8} {'reward':>6} {'adv':>7}")
        for i in range(min(limit, len(rewards))):
            prompt, resp, ans = (h[k][i].decode() for k in ("prompt", "response", "answer"))
            print(f"{prompt!r:<14} {resp!r:<14} {ans!r:<8} {rewards[i]:>6.2f} {adv[i]:>+7.3f}")
    return 0
