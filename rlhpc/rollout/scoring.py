"""Scoring samples with the user's reward, on the driver.

A reward is either form, told apart by its signature:

- ``reward(sample: Sample) -> float | dict``: everything about the sample (prompt text and chat
  messages, response text and ids, label, the data row's other fields, finish reason);
- ``reward(prompt, response, answer) -> float | dict``: the older form, unchanged.

A dict reward (``{"score": 1.0, "format": 0.5}``) trains on ``score`` and logs every part as
``reward/<part>``. A reward that raises is one error naming the function and the sample, or,
with ``data.reward_errors: zero``, scores 0 and is counted (``reward/errors``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhpc.errors import ConfigError, RlhpcError

SIGNATURES = "reward(sample) or reward(prompt, response, answer), returning a float or a dict with 'score'"


class RewardError(RlhpcError):
    # A grader may fail for a moment (a remote one, a resource): the job requeues on it as on a
    # crash (checkpoint.requeue_on_failure), and a grader failing every time ends held.
    transient = True


@dataclass(frozen=True)
class Sample:
    """One generated response as a reward sees it."""

    prompt: str  # the text the model was given (a chat prompt: as its template rendered it)
    response: str
    label: str
    response_ids: list[int] = field(default_factory=list)
    messages: list[dict] | None = None  # a chat prompt's messages
    metadata: dict = field(default_factory=dict)  # the data row's other fields
    finish_reason: str | None = None  # "stop", "length" or "abort"

    @property
    def answer(self) -> str:  # the older form's name for the label
        return self.label

    @property
    def response_length(self) -> int:
        return len(self.response_ids)


def takes_sample(fn: Callable, spec: str) -> bool:
    """Which form ``fn`` is: True for ``reward(sample)``; any other signature is an error."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: assume the older form
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(required) == 1 and len(positional) < 3 and not varargs:
        return True
    if len(required) <= 3 and (len(positional) >= 3 or varargs):
        return False
    raise ConfigError(f"data.reward = {spec!r} takes {len(required)} arguments", f"write {SIGNATURES}")


class Scorer:
    """Score a list of samples: (scores, parts) where parts maps each dict part (and ``errors``
    where rewards may fail) to one value per sample."""

    def __init__(self, fn: Callable, spec: str, errors: str = "raise"):
        self.fn, self.spec, self.errors = fn, spec, errors
        self.sample_form = takes_sample(fn, spec)

    def __call__(self, samples: list[Sample]) -> tuple[list[float], dict[str, list[float]]]:
        scores: list[float] = []
        parts: dict[str, list[float]] = {}
        failed: list[float] = []
        for i, s in enumerate(samples):
            try:
                value = self.fn(s) if self.sample_form else self.fn(s.prompt, s.response, s.label)
                score, extra = self._read(value)
                failed.append(0.0)
            except RlhpcError:
                raise
            except Exception as e:
                if self.errors != "zero":
                    raise RewardError(
                        f"the reward {self.spec} raised {type(e).__name__}: {e} on the sample with prompt "
                        f"{s.prompt[:80]!r} and response {s.response[:80]!r}",
                        "fix the reward, or set data.reward_errors: zero to score such samples 0 and count them",
                    ) from e
                score, extra = 0.0, {}
                failed.append(1.0)
            scores.append(score)
            for key, v in extra.items():
                parts.setdefault(key, [math.nan] * i).append(v)
            for key in parts:
                if len(parts[key]) < i + 1:
                    parts[key].append(math.nan)  # a part this sample's dict did not have
        if self.errors == "zero":
            parts["errors"] = failed
        return scores, parts

    def _read(self, value: Any) -> tuple[float, dict[str, float]]:
        if isinstance(value, dict):
            if "score" not in value:
                raise RlhpcError(
                    f"the reward {self.spec} returned a dict without 'score' (keys: {', '.join(map(str, value))})",
                    "return {'score': <what to train on>, ...other parts to log}",
                )
            return float(value["score"]), {str(k): float(v) for k, v in value.items() if k != "score"}
        return float(value), {}
