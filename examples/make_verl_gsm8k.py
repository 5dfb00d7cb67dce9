"""Write GSM8K-shaped data in verl's Parquet layout, to try a verl job on the tiny model.

    python examples/make_verl_gsm8k.py data/gsm8k          # train.parquet, test.parquet, hard.parquet

The columns are those verl's ``examples/data_preprocess/gsm8k.py`` writes: ``data_source``
("openai/gsm8k"), ``prompt`` (chat messages: the question and verl's instruction to answer after
"####"), ``ability``, ``reward_model`` (``{"style": "rule", "ground_truth": "18"}``) and
``extra_info`` (split, index, the question and the worked answer). The problems are short
generated word problems, not GSM8K's own, so that nothing is downloaded and a prompt fits the
tiny model's context; point rlhpc at verl's real files the same way.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ("Ann", "Bo", "Cy", "Di")
THINGS = ("pens", "cups", "eggs", "cards")


def problem(rng: random.Random, hard: bool) -> tuple[str, str, int]:
    """(question, worked answer ending in "#### N", N)."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    if hard:  # two steps
        c = rng.randint(2, 4)
        n = (a + b) * c
        q = f"{name} has {a} {thing}, gets {b} more, then {c} times that. How many {thing}?"
        return q, f"{a}+{b}={a + b}. {a + b}*{c}={n}.\n#### {n}", n
    n = a + b
    return f"{name} has {a} {thing} and gets {b} more. How many {thing}?", f"{a}+{b}={n}.\n#### {n}", n


def rows(split: str, count: int, seed: int, hard: bool = False) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        question, answer, n = problem(rng, hard)
        out.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(n)},
                "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--train", type=int, default=256, help="training rows (default: 256)")
    p.add_argument("--test", type=int, default=32, help="rows of test.parquet and of hard.parquet (default: 32)")
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, table in (
        ("train", rows("train", args.train, 0)),
        ("test", rows("test", args.test, 1)),
        ("hard", rows("test", args.test, 2, hard=True)),
    ):
        pq.write_table(pa.Table.from_pylist(table), args.out_dir / f"{name}.parquet")
        print(f"wrote {args.out_dir / f'{name}.parquet'} ({len(table)} rows)")


if __name__ == "__main__":
    main()
