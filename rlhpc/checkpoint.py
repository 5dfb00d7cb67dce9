"""Checkpoints that cannot be half-written, and the one place that decides where to resume.

Layout under ``RUN_DIR/checkpoints``::

    rollout_000009/            a complete checkpoint (one per saved rollout id)
        actor/                 model (HF format), optimizer, per-rank RNG (written by the actor ranks)
        trainer_state.json     rollout id, data position, weight version, driver RNG, run ids ...
        COMPLETE               manifest of every file and its size, written last
    latest                     name of the newest complete checkpoint (for tools), replaced atomically
    .staging-rollout_000010/   a save in progress; never read

A save is staged under a temporary name and renamed only once every file and the manifest
are on disk, so a crash at any moment leaves either the previous checkpoint or the new one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rlhpc.util.files import fsync_dir, write_atomic

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
STATE = "trainer_state.json"
LATEST = "latest"
PREFIX = "rollout_"
STAGING = ".staging-"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    rollout_id: int  # the last rollout whose training this checkpoint contains
    state: dict  # trainer_state.json

    @property
    def next_rollout_id(self) -> int:
        return self.rollout_id + 1


def checkpoint_name(rollout_id: int) -> str:
    return f"{PREFIX}{rollout_id:06d}"


def _manifest(root: Path) -> dict[str, int]:
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MARKER:
            files[str(p.relative_to(root))] = p.stat().st_size
    return files


def validate(path: Path) -> str | None:
    """Why ``path`` is not a usable checkpoint, or None when it is."""
    marker = path / MARKER
    if not marker.is_file():
        return f"{path.name} has no {MARKER} marker (save interrupted?)"
    try:
        manifest = json.loads(marker.read_text())
        json.loads((path / STATE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"{path.name}: unreadable marker or state ({e})"
    for rel, size in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            return f"{path.name}: missing {rel}"
        if f.stat().st_size != size:
            return f"{path.name}: {rel} is {f.stat().st_size} bytes, manifest says {size}"
    return None


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last
        self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ saving

    def stage(self, rollout_id: int) -> Path:
        """A fresh, empty directory for the writers of checkpoint ``rollout_id``."""
        staging = self.root / f"{STAGING}{checkpoint_name(rollout_id)}"
        if staging.exists():  # left over from a save that was killed
            shutil.rmtree(staging)
        staging.mkdir()
        return staging

    def commit(self, staging: Path, rollout_id: int, state: dict) -> Checkpoint:
        """Seal a staged checkpoint: state, fsync, manifest, rename, ``latest``, retention."""
        state = {**state, "rollout_id": rollout_id}
        (staging / STATE).write_text(json.dumps(state, indent=1))
        for p in staging.rglob("*"):
            if p.is_file():
                with open(p, "rb+") as f:
                    os.fsync(f.fileno())
        write_atomic(staging / MARKER, json.dumps({"rollout_id": rollout_id, "files": _manifest(staging)}, indent=1))
        final = self.root / checkpoint_name(rollout_id)
        if final.exists():  # the same rollout saved again after a resume: replace it whole
            trash = self.root / f"{STAGING}old-{final.name}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            os.replace(staging, final)
            shutil.rmtree(trash)
        else:
            os.replace(staging, final)
        fsync_dir(self.root)
        write_atomic(self.root / LATEST, final.name + "\n")
        self._prune()
        log.info("checkpoint %s saved", final)
        return Checkpoint(final, rollout_id, state)

    def _prune(self) -> None:
        complete = self._complete_dirs()
        for old in complete[: -self.keep_last]:
            shutil.rmtree(old)
            log.info("checkpoint %s removed (keep_last=%d)", old.name, self.keep_last)

    # ------------------------------------------------------------ resuming

    def _complete_dirs(self) -> list[Path]:
        """Checkpoint directories in rollout order (validity not checked)."""
        return sorted(p for p in self.root.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX) :].isdigit())

    def latest(self) -> Checkpoint | None:
        """The newest valid checkpoint. Falls back past damaged ones, with a warning.

        Directories are validated rather than trusting ``latest``: a crash between the rename
        and the pointer update leaves a newer complete checkpoint that is safe to use.
        """
        for path in reversed(self._complete_dirs()):
            reason = validate(path)
            if reason is None:
                state = json.loads((path / STATE).read_text())
                return Checkpoint(path, int(state["rollout_id"]), state)
            log.warning("skipping checkpoint: %s; falling back to an older one", reason)
        return None
