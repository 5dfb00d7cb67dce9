"""Where a run's numbers go: a console line, ``metrics.jsonl``, wandb, and HDF5 rollout dumps."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import h5py
import numpy as np

from rlhpc.batch import RolloutBatch
from rlhpc.config import LoggingConfig
from rlhpc.run_dir import RunDir
from rlhpc.util.files import write_atomic

log = logging.getLogger("rlhpc.metrics")


def read_metrics(run: RunDir | str | Path) -> list[dict]:
    path = RunDir.of(run).metrics_file
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _console_line(kind: str, rollout_id: int, num_rollout: int, values: dict) -> str:
    keys = (
        ("reward", "reward {:.3f}"),
        ("response_len", "len {:.1f}"),
        ("loss", "loss {:+.4f}"),
        ("kl", "kl {:.4f}"),
        ("grad_norm", "gnorm {:.3f}"),
        ("time/step", "step {:.2f}s"),
        ("time/generate", "(gen {:.2f}s"),
        ("time/train", "train {:.2f}s"),
        ("time/update_weights", "sync {:.2f}s)"),
    )
    parts = [fmt.format(values[k]) for k, fmt in keys if k in values]
    return f"{kind:<7} {rollout_id + 1:>5}/{num_rollout} | " + " ".join(parts)


def _ragged(f: h5py.File, name: str, rows: list[list], dtype: type) -> None:
    data = np.empty(len(rows), dtype=object)  # filled one by one: equal lengths must stay ragged
    for i, row in enumerate(rows):
        data[i] = np.asarray(row, dtype=dtype)
    f.create_dataset(name, data=data, dtype=h5py.vlen_dtype(dtype))


class MetricsLogger:
    """One JSON object per rollout/eval in ``metrics.jsonl``; mirrored to wandb and the console."""

    def __init__(self, run: RunDir, cfg: LoggingConfig, config: dict, num_rollout: int, wandb_id: str | None):
        self.run = run
        self.cfg = cfg
        self.num_rollout = num_rollout
        self.path = run.metrics_file
        self._wandb = None
        self.wandb_id = wandb_id
        if cfg.wandb_mode != "disabled":
            import wandb

            # A resumed job passes the id from its checkpoint and continues the same wandb run.
            self._wandb = wandb.init(
                project=cfg.wandb_project,
                dir=str(run.path),
                mode=cfg.wandb_mode,
                id=wandb_id,
                resume="allow",
                config=config,
                name=run.path.name,
                settings=wandb.Settings(quiet=True, console="off"),
            )
            self.wandb_id = self._wandb.id

    def rewind(self, next_rollout_id: int) -> None:
        """Drop records of rollouts after the checkpoint we resume from: they are recomputed."""
        if not self.path.is_file():
            return
        kept = [r for r in read_metrics(self.run) if r["rollout_id"] < next_rollout_id]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def restore(self, rollout_id: int, values: dict[str, float]) -> None:
        """Re-add a checkpointed rollout's record if the job died before writing it."""
        if not any(r["kind"] == "rollout" and r["rollout_id"] == rollout_id for r in read_metrics(self.run)):
            self.log("rollout", rollout_id, values)

    def log(self, kind: str, rollout_id: int, values: dict[str, float]) -> None:
        record = {"kind": kind, "rollout_id": rollout_id, **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        log.info(_console_line(kind, rollout_id, self.num_rollout, values))
        if self._wandb is not None:
            # wandb steps count trained rollouts, so the untrained baseline (rollout_id -1) is step 0.
            self._wandb.log({f"{kind}/{k}": v for k, v in values.items()}, step=rollout_id + 1)

    def dump_rollout(self, rollout_id: int, batch: RolloutBatch, texts: dict[str, list[str]]) -> Path | None:
        """Write one rollout's tokens, texts, rewards and advantages to ``rollouts/rollout_NNNNNN.h5``."""
        if not self.cfg.dump_rollouts:
            return None
        self.run.rollouts_dir.mkdir(exist_ok=True)
        path = self.run.rollout_dump(rollout_id)
        tmp = path.with_suffix(".h5.tmp")
        with h5py.File(tmp, "w") as f:
            f.attrs["rollout_id"] = rollout_id
            f.attrs["group_size"] = batch.group_size
            _ragged(f, "prompt_ids", batch.prompt_ids, np.int32)
            _ragged(f, "response_ids", batch.response_ids, np.int32)
            _ragged(f, "rollout_logprobs", batch.rollout_logprobs, np.float32)
            f.create_dataset("rewards", data=batch.rewards.numpy())
            f.create_dataset("advantages", data=batch.advantages.numpy())
            for name, values in texts.items():
                f.create_dataset(name, data=values, dtype=h5py.string_dtype())
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
