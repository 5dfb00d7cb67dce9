"""Print one rollout dump (RUN_DIR/rollouts/rollout_NNNNNN.h5): prompts, responses, rewards, and
which tokens were trained.

python tools/show_rollout.py runs/embedded 42          # rollout id 42
python tools/show_rollout.py runs/embedded/rollouts/rollout_000042.h5 --limit 16
python tools/show_rollout.py runs/embedded --full      # prompts whole, not cut to --prompt-chars

Each sample's response is shown in pieces, one per turn and kind: ``+`` the tokens trained on
(the engine's, loss mask 1), ``-`` the tokens masked out (observations, tool answers, template
tokens, loss mask 0; and every token of a sample rollout.overlong_filter masked). The pieces
are decoded with the run's tokenizer (its model.path, or RUN_DIR/base_model; --tokenizer to
give another); without one, the response is shown whole with its token counts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

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


def run_tokenizer(dump: Path) -> Any | None:
    """The tokenizer of the run that wrote ``dump`` (RUN_DIR/rollouts/X.h5), or None if there is
    none to load (a dump copied elsewhere, a model no longer there)."""
    import yaml

    run = RunDir(dump.parent.parent)
    if not run.config_file.is_file():
        return None
    model = ((yaml.safe_load(run.config_file.read_text()) or {}).get("model") or {}).get("path") or run.base_model
    return load_tokenizer(model)


def load_tokenizer(path: str | Path) -> Any | None:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        return None


def pieces(ids: list[int], mask: list[int] | None, turns: list[int] | None) -> list[tuple[int, bool, list[int]]]:
    """``ids`` as runs of (turn, trained, ids): a new run wherever the turn or the mask changes.
    No mask: every token trained; no turns: all turn 0."""
    out: list[tuple[int, bool, list[int]]] = []
    for k, t in enumerate(ids):
        key = (turns[k] if turns is not None else 0, bool(mask[k]) if mask is not None else True)
        if out and out[-1][:2] == key:
            out[-1][2].append(int(t))
        else:
            out.append((*key, [int(t)]))
    return out


def cut(text: str, chars: int | None) -> str:
    """``text`` as shown: whole, or its last ``chars`` characters (a rendered chat ends with the
    question) and how long it was."""
    if chars is None or len(text) <= chars:
        return repr(text)
    return f"...{text[-chars:]!r} ({len(text)} chars; --full shows it whole)"


def sample_lines(h: Any, i: int, tokenizer: Any | None, prompt_chars: int | None) -> list[str]:
    """What is shown of sample ``i``: a header, the prompt, the response in pieces (``pieces``)."""
    reward, adv = float(h["rewards"][i]), float(h["advantages"][i])
    answer = h["answer"][i].decode()
    if "response_ids" not in h:  # a dump without token ids (written by hand): the texts alone
        tokenizer = None
    ids = [int(t) for t in h["response_ids"][i]] if "response_ids" in h else []
    mask = [int(m) for m in h["loss_mask"][i]] if "loss_mask" in h else None
    turns = [int(t) for t in h["turn"][i]] if "turn" in h else None
    parts = pieces(ids, mask, turns)
    trained = sum(len(p) for _, on, p in parts if on)
    head = f"sample {i}: reward {reward:.2f} adv {adv:+.3f} answer {answer!r}, {trained} of {len(ids)} tokens trained"
    if turns is not None:
        head += f", {max(turns, default=0) + 1} turn(s)"
    if "truncated" in h and bool(h["truncated"][i]):
        head += ", cut at its limit"
    lines = [head, f"  prompt   {cut(h['prompt'][i].decode(), prompt_chars)}"]
    if tokenizer is None:
        lines.append(f"  response {h['response'][i].decode()!r}")
        return lines
    for turn, on, piece in parts:
        text = tokenizer.decode(piece, skip_special_tokens=False)
        lines.append(f"  turn {turn:<3} {'+' if on else '-'} {text!r}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    """This command's options; the docs test checks the commands the docs show against it."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, help="a run dir or an .h5 dump")
    p.add_argument("rollout_id", type=int, nargs="?", help="default: the newest dump")
    p.add_argument("--limit", type=int, default=24, help="samples to print")
    p.add_argument("--prompt-chars", type=int, default=160, help="a prompt's last N characters shown (default: 160)")
    p.add_argument("--full", action="store_true", help="show every prompt whole")
    p.add_argument("--tokenizer", type=Path, help="decode with this tokenizer (default: the run's)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        f = find(args.path, args.rollout_id)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else run_tokenizer(f)
        return show(f, args.limit, tokenizer, None if args.full else args.prompt_chars)
    except RlhpcError as e:
        print("error: " + "\n".join(printable(line) for line in str(e).splitlines()), file=sys.stderr)
        return 1


def show(f: Path, limit: int, tokenizer: Any | None, prompt_chars: int | None) -> int:
    # the dump may come from anyone: checked as it opens, every text of it printed escaped (repr)
    with open_rollout_dump(f) as h:
        rewards = h["rewards"][:]
        rollout_id, group_size = printable(h.attrs["rollout_id"]), printable(h.attrs["group_size"])
        print(
            f"{printable(f)}: rollout {rollout_id}, {len(rewards)} samples, group size {group_size}, "
            f"mean reward {rewards.mean():.3f}"
        )
        print("  + trained (loss mask 1), - masked out (loss mask 0)" if tokenizer else "  (no tokenizer: texts whole)")
        for i in range(min(limit, len(rewards))):
            print("\n".join(sample_lines(h, i, tokenizer, prompt_chars)))
    return 0
