"""A run's directory: the one place a job's config, model, checkpoints, logs and metrics live.

RUN_DIR/
  config.yaml        the resolved config (written before submission)
  base_model/        the tiny model built at submit time, when ``model.tiny`` is used
  checkpoints/       see rlhpc/checkpoint.py
  metrics.jsonl      one JSON object per rollout and per eval
  rollouts/          HDF5 dump per rollout id
  logs/              submitit task logs, engine server logs
  FINISHED           written when the last rollout is saved
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from rlhpc.checkpoint import write_atomic
from rlhpc.config import Config, config_from_dict, config_to_dict, dump_config
from rlhpc.errors import RunDirError

# Changing these between submissions of the same run keeps a resume meaningful.
RESUMABLE_CHANGES = (
    "rollout.num_rollout",
    "rollout.num_epoch",
    "eval.",
    "logging.",
    "checkpoint.save_interval",
    "checkpoint.keep_last",
)


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(old: dict, new: dict) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        self.config_file = self.path / "config.yaml"
        self.checkpoints = self.path / "checkpoints"
        self.logs = self.path / "logs"
        self.base_model = self.path / "base_model"
        self.finished_file = self.path / "FINISHED"

    def __str__(self) -> str:
        return str(self.path)

    def is_finished(self) -> bool:
        return self.finished_file.is_file()

    def model_path(self, cfg: Config) -> str:
        return cfg.model.path if cfg.model.path is not None else str(self.base_model)

    def load_config(self) -> Config:
        return config_from_dict(yaml.safe_load(self.config_file.read_text()))

    def prepare(self, cfg: Config, force: bool = False) -> None:
        """Create or re-open the run dir for ``cfg``. Refuses what would lose or mix results."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise RunDirError(
                f"run dir {self.path} is not writable ({e.strerror})", "pass --run-dir on a filesystem you can write to"
            ) from e
        if self.is_finished():
            raise RunDirError(
                f"run dir {self.path} holds a finished run ({self.finished_file.read_text().strip()})",
                "pass a new --run-dir to train again (the finished run is kept as it is)",
            )
        if self.config_file.is_file():
            old = yaml.safe_load(self.config_file.read_text())
            changed = [k for k in config_differences(old, config_to_dict(cfg)) if not k.startswith(RESUMABLE_CHANGES)]
            if changed and not force:
                raise RunDirError(
                    f"run dir {self.path} holds a run with a different config ({', '.join(changed)}); resuming it under "
                    "this config would mix two experiments",
                    "pass a new --run-dir, or --force to resume this run under the new config",
                )
        write_atomic(self.config_file, dump_config(cfg))
        if cfg.model.tiny is not None and not self.base_model.exists():
            from rlhpc.model import build_tiny_model

            build_tiny_model(self.base_model, cfg.model.tiny)
        self.logs.mkdir(exist_ok=True)

    def mark_finished(self, summary: dict) -> None:
        write_atomic(
            self.finished_file, json.dumps({**summary, "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n"
        )
