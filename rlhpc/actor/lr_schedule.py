"""The learning rate of each optimizer step (``actor.lr_schedule``), for both actor backends.

A pure function of the number of optimizer steps already taken, which every checkpoint saves
(``optimizer_steps``): a resumed run sets the same rate on the same step with no scheduler
state to save, and both backends follow the same curve.
"""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, schedule: str, warmup_steps: int, decay_steps: int, min_lr: float) -> float:
    """The rate of optimizer step ``step`` (0 for the first):

    * warmup (``step < warmup_steps``): lr * (step + 1) / warmup_steps, so the first step moves;
    * then, with p = (step - warmup_steps) / (decay_steps - warmup_steps) capped at 1:
      ``constant``: lr; ``linear``: min_lr + (lr - min_lr) * (1 - p);
      ``cosine``: min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2.

    ``decay_steps``: the step at which the decay reaches ``min_lr`` (it stays there after).
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    p = min(1.0, (step - warmup_steps) / max(decay_steps - warmup_steps, 1))
    if schedule == "linear":
        return min_lr + (lr - min_lr) * (1.0 - p)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown lr schedule {schedule!r}: constant, linear or cosine")
