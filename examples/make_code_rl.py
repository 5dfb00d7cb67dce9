"""Write a small code dataset in verl's Parquet layout, to try a code RL job on the tiny model.

    python examples/make_code_rl.py data/code          # train.parquet, test.parquet

The columns are those of verl's code datasets (PRIME's Eurus code data, DeepCoder's):
``data_source``, ``prompt`` (chat messages: the problem and the instruction to answer in a
```python block), ``ability`` ("code"), ``reward_model`` (``{"style": "rule", "ground_truth":
TESTS}``, the tests as JSON text) and ``extra_info``. The problems are generated, one of each of
the test forms ``rlhpc.rewards:code`` reads, so nothing is downloaded: stdin/stdout tests
(``{"inputs", "outputs"}``), calls of a named function (``"fn_name"``), and asserts.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

INSTRUCTION = "Write the solution in Python, in one ```python code block."


def problem(rng: random.Random) -> tuple[str, str, str]:
    """(data source, statement, tests as JSON text)."""
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    kind = rng.choice(("stdio", "call", "asserts"))
    if kind == "stdio":
        cases = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(3)]
        tests = {"inputs": [f"{x} {y}\n" for x, y in cases], "outputs": [f"{a * x + y}\n" for x, y in cases]}
        return "codecontests", f"Read two integers x and y from one line and print {a}*x + y.", json.dumps(tests)
    if kind == "call":
        cases = [rng.randint(0, 50) for _ in range(3)]
        tests = {"inputs": [[x] for x in cases], "outputs": [x * a - b for x in cases], "fn_name": "solve"}
        return "apps", f"Write a function solve(x) that returns {a}*x - {b}.", json.dumps(tests)
    cases = [rng.randint(0, 20) for _ in range(3)]
    tests = [f"assert f({x}) == {x + a}" for x in cases]
    return "mbpp", f"Write a function f(x) that adds {a} to x.", json.dumps(tests)


def rows(split: str, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        source, statement, tests = problem(rng)
        out.append(
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": f"{statement} {INSTRUCTION}"}],
                "ability": "code",
                "reward_model": {"style": "rule", "ground_truth": tests},
                "extra_info": {"split": split, "index": index},
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=64)
    ap.add_argument("--test", type=int, default=16)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for split, count, seed in (("train", args.train, 0), ("test", args.test, 1)):
        pq.write_table(pa.Table.from_pylist(rows(split, count, seed)), args.out / f"{split}.parquet")
        print(args.out / f"{split}.parquet")


if __name__ == "__main__":
    main()
