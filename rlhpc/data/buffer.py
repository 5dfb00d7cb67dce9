"""Prompt order across epochs: a pure function of (seed, rollout id).

Rollout ``i`` takes rows ``[k*B, (k+1)*B)`` of epoch ``i // per_epoch``'s permutation, so the
data position never drifts from the model checkpoint: resuming at rollout ``i`` needs only
``i``. ``state_dict`` records what the order depends on, to refuse a resume on changed data.
The driver owns the buffer: it draws each rollout's rows, and saves and checks its state.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import TYPE_CHECKING

from rlhpc.config import eval_split
from rlhpc.data.rows import Row, as_rows
from rlhpc.data.tasks import TASKS, load_split
from rlhpc.errors import ConfigError

if TYPE_CHECKING:
    from rlhpc.config import DataConfig, EvalSetConfig
    from rlhpc.data.prompts import PromptPrep


class DataBuffer:
    def __init__(self, rows: list[dict], rollout_batch_size: int, seed: int):
        rows = as_rows(rows)
        if len(rows) < rollout_batch_size:
            raise ConfigError(
                f"the training data has {len(rows)} prompts, fewer than rollout.rollout_batch_size = {rollout_batch_size}",
                "add data (data.num_train / data.train_file) or lower rollout.rollout_batch_size",
            )
        self.rows = rows
        self.batch_size = rollout_batch_size
        self.seed = seed
        self.num_rollout_per_epoch = len(rows) // rollout_batch_size  # a partial last batch is dropped
        self._order_cache: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = list(range(len(self.rows)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def position(self, rollout_id: int) -> tuple[int, int]:
        """(epoch, first row index within that epoch's order) of rollout ``rollout_id``."""
        epoch, k = divmod(rollout_id, self.num_rollout_per_epoch)
        return epoch, k * self.batch_size

    def batch(self, rollout_id: int) -> list[Row]:
        epoch, start = self.position(rollout_id)
        order = self._order(epoch)
        return [self.rows[i] for i in order[start : start + self.batch_size]]

    def extra_rows(self, rollout_id: int, round: int, count: int) -> list[Row]:
        """``count`` more prompts for rollout ``rollout_id``'s dynamic-sampling round ``round``: drawn
        from all rows (without repeats while there are enough) by a pure function of
        (seed, rollout id, round), so a rerun or a resume draws the same ones."""
        rng = random.Random(f"{self.seed}:extra:{rollout_id}:{round}")
        n = len(self.rows)
        picks = rng.sample(range(n), count) if count <= n else rng.choices(range(n), k=count)
        return [self.rows[i] for i in picks]

    def is_epoch_end(self, rollout_id: int) -> bool:
        return (rollout_id + 1) % self.num_rollout_per_epoch == 0

    def fingerprint(self) -> str:
        """What the prompts and labels are, in file order (not their metadata, which may not be JSON)."""
        core = [{"prompt": r.prompt_text, "answer": r.label} for r in self.rows]
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]

    def state_dict(self, next_rollout_id: int) -> dict:
        epoch, start = self.position(next_rollout_id)
        return {
            "next_rollout_id": next_rollout_id,
            "epoch": epoch,
            "offset": start,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "data_fingerprint": self.fingerprint(),
        }

    def check_resume(self, state: dict) -> None:
        """Refuse to resume when the data or its order changed since the checkpoint."""
        for key, now in (
            ("seed", self.seed),
            ("batch_size", self.batch_size),
            ("data_fingerprint", self.fingerprint()),
        ):
            if state.get(key) != now:
                raise ConfigError(
                    f"the checkpoint's data {key} is {state.get(key)!r} but this run's is {now!r}: "
                    "resuming would replay or skip prompts",
                    "resume with the data and rollout settings the run started with, or start a new --run-dir",
                )


def load_data(
    data: DataConfig, rollout_batch_size: int, seed: int, prepare: PromptPrep | None = None
) -> tuple[DataBuffer, list[Row]]:
    """The training buffer and the eval rows of ``data.task`` (or of its files), each split
    passed through ``prepare`` (``rlhpc.data.prompts.prepare_prompts``) before the order is drawn."""
    eval_rows = load_split(
        TASKS[data.task], data.eval_file, data.num_eval, data.seed + 1, data.prompt_key, data.label_key, data.image_key
    )
    if prepare is not None:
        eval_rows = prepare("eval", eval_rows)
    return load_train(data, rollout_batch_size, seed, prepare), eval_rows


def load_train(data: DataConfig, rollout_batch_size: int, seed: int, prepare: PromptPrep | None = None) -> DataBuffer:
    """The training buffer of ``data.task`` (or of its file)."""
    rows = load_split(
        TASKS[data.task], data.train_file, data.num_train, data.seed, data.prompt_key, data.label_key, data.image_key
    )
    return DataBuffer(prepare("train", rows) if prepare is not None else rows, rollout_batch_size, seed)


def load_eval_sets(
    data: DataConfig, sets: dict[str, EvalSetConfig], prepare: PromptPrep | None = None
) -> dict[str, list[Row]]:
    """Each eval set's rows (``EvalConfig.resolved_sets``): its file, or the task's generated eval
    split (the same rows for every set without a file), through ``prepare`` under its split name."""
    task = TASKS[data.task]
    out = {}
    for name, s in sets.items():
        rows = load_split(task, s.file, data.num_eval, data.seed + 1, s.prompt_key, s.label_key, data.image_key)
        out[name] = prepare(eval_split(name), rows) if prepare is not None else rows
    return out
