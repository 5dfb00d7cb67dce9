"""Toy tasks: generated prompt/answer data plus a reward function, selected by ``data.task``.

A reward function is ``reward(prompt: str, response: str, answer: str) -> float``; users can
plug their own with ``data.reward: "my_module:my_reward"``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlhpc.data import code, guess, squares
from rlhpc.data.files import read_rows
from rlhpc.data.rows import Row, as_rows
from rlhpc.errors import ConfigError
from rlhpc.util.imports import import_function

if TYPE_CHECKING:
    from rlhpc.config import DataConfig, RolloutConfig

RewardFn = Callable[[str, str, str], float]


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[int, random.Random], list[dict]]  # (count, rng) -> [{"prompt", "answer"}]
    reward: RewardFn
    description: str
    env: str | None = None  # multi-turn: the environment ("module:Class") its episodes run in
    images: bool = False  # its prompts hold images (a vision-language model's task)


def _digit_sum_data(count: int, rng: random.Random) -> list[dict]:
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(pairs)
    rows = [pairs[i % len(pairs)] for i in range(count)]
    return [{"prompt": f"{a}+{b}=", "answer": str((a + b) % 10)} for a, b in rows]


def _digit_sum_reward(prompt: str, response: str, answer: str) -> float:
    # Anything after the digit is ignored: a random policy then hits 1 in ~48, enough to learn from.
    return 1.0 if response.startswith(answer) else 0.0


def _reverse_data(count: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(count):
        word = "".join(rng.choice("abcde") for _ in range(3))
        rows.append({"prompt": f"{word}:", "answer": word[::-1]})
    return rows


def _reverse_reward(prompt: str, response: str, answer: str) -> float:
    # Fraction of positions right: dense enough to learn from scratch.
    hits = sum(1 for a, b in zip(response, answer) if a == b)
    return hits / max(len(answer), len(response), 1)


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("digit_sum", _digit_sum_data, _digit_sum_reward, "'a+b=' -> (a+b) mod 10"),
        Task("reverse", _reverse_data, _reverse_reward, "'abc:' -> 'cba'"),
        Task(
            "guess", guess.make, guess.reward, "guess 1-8, told higher/lower (multi-turn)", "rlhpc.data.guess:GuessEnv"
        ),
        Task(
            "squares",
            squares.make,
            squares.reward,
            "a picture -> how many squares (a vision-language model's)",
            images=True,
        ),  # fmt: skip
        Task(
            "code",
            code.make,
            code.reward,
            "'0:5;1:6;x:x' -> the rest of a Python expression passing the row's asserts (+5)",
        ),
    )
}


def check_task(data: DataConfig) -> None:
    if data.task not in TASKS:
        raise ConfigError(f"data.task = {data.task!r} is not a known task", f"use one of: {', '.join(sorted(TASKS))}")


def task_env(data: DataConfig, rollout: RolloutConfig) -> str | None:
    """The run's environment: rollout.env, else the data.task's own (a multi-turn task's), else None."""
    return rollout.env or TASKS[data.task].env


def check_scored(data: DataConfig, files: list[tuple[str, str, str, str]], env: str | None) -> None:
    """Data files are scored by data.reward (or an environment): a toy task's reward knows only its own data.
    ``files``: (key, file, prompt key, label key) of each file the run reads."""
    if files and data.reward is None and env is None:  # tools without an env: data.reward scores the replies
        raise ConfigError(
            f"{' / '.join(k for k, *_ in files)} set but data.reward is not: the toy task {data.task!r}'s "
            "reward would score your data",
            'set data.reward: rlhpc.rewards:gsm8k ("#### N"), rlhpc.rewards:math (\\boxed{}), rlhpc.rewards:exact, '
            "or your own module:function (verl's compute_score too)",
        )


def resolve_reward(spec: str) -> RewardFn:
    """Import ``"package.module:function"``; errors name the spec and the fix."""
    return import_function("data.reward", spec, "reward(prompt, response, answer) -> float")


def load_split(
    task: Task,
    file: str | None,
    count: int,
    seed: int,
    prompt_key: str = "prompt",
    label_key: str = "answer",
    image_key: str = "images",
) -> list[Row]:
    """Rows from ``file`` if given (``rlhpc.data.files``), else ``count`` rows generated
    deterministically from ``seed`` (a generated row's columns: ``prompt`` and ``answer``)."""
    if file is not None:
        return read_rows(file, prompt_key, label_key, image_key)
    return as_rows(task.make(count, random.Random(seed)))
