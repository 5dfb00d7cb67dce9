"""The built-in multi-turn task ``guess``: the model guesses a number from 1 to 8; the environment
answers "higher" or "lower" until it is named. The reward is 1 / (replies used): it grows with
fewer turns, and an episode cut before the number is named scores 0."""

from __future__ import annotations

import random
import re

LOW, HIGH = 1, 8
QUESTION = f"guess {LOW}-{HIGH}"
_DIGIT = re.compile(r"\d")


def make(count: int, rng: random.Random) -> list[dict]:
    return [{"prompt": QUESTION, "answer": str(rng.randint(LOW, HIGH))} for _ in range(count)]


def first_guess(text: str) -> int | None:
    found = _DIGIT.search(text)
    return int(found.group()) if found else None


def reward(prompt: str, response: str, answer: str) -> float:
    """A single reply scored alone (the episodes' reward is the environment's)."""
    return 1.0 if first_guess(response) == int(answer) else 0.0


class GuessEnv:
    """``reset`` asks for a guess, ``step`` answers it (``rlhpc.rollout.episodes`` for the interface)."""

    def reset(self, row: dict) -> list[dict]:
        self.secret, self.replies = int(row.label), 0
        return [{"role": "user", "content": QUESTION}]

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        self.replies += 1
        guess = first_guess(reply)
        if guess == self.secret:
            return [], 1.0 / self.replies, True
        hint = "a digit" if guess is None else ("higher" if guess < self.secret else "lower")
        return [{"role": "user", "content": hint}], 0.0, False
