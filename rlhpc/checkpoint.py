"""Checkpoints that cannot be half-written, and the one place that decides where to resume.

Layout under ``RUN_DIR/checkpoints``::

    rollout_000009/            a complete checkpoint (one per saved rollout id)
        actor/                 model (HF format), optimizer, per-rank RNG (written by the actor ranks)
        trainer_state.json     rollout id, data position, weight version, driver RNG, run ids ...
        COMPLETE               manifest of every file, its size and its CRC-32, written last
    latest                     name of the newest complete checkpoint (for tools), replaced atomically
    .staging-rollout_000010/   a save in progress; never read
    superseded-20250101T120000Z/   checkpoints set aside, never read or removed by rlhpc (below)

A save is staged under a temporary name and renamed only once every file and the manifest
are on disk, so a crash at any moment leaves either the previous checkpoint or the new one.
A save that fails (a full disk: ENOSPC, a quota) removes its staging directory and says which
filesystem is full; staging left by a killed job is removed at the next start (``clean_debris``).

Asynchronous saves (``save_async``, ``checkpoint.async_save``): the caller waits only for the
snapshot step (the actor ranks copy their state to host memory); the rest of the write and the
commit run on a background thread. At most one save is in flight: the next save, a stop and
the end of the run ``wait`` for it, and a background save that failed raises there. The commit
is the same as a blocking save's, so a crash at any moment still leaves the previous checkpoint
or the new one. Writers that sum their files as they write them (the actor ranks) hand the
sizes and CRC-32s to the commit, which then does not read those files back.

Loading checks every file against the manifest: its size, and its CRC-32 (manifests written
before checksums were added are checked by size only). A damaged checkpoint is skipped with a
warning and the previous one is used.

Retention, after each commit: the checkpoint just committed is always kept, and with it the
newest valid older ones up to ``keep_last`` in all; damaged older directories are removed (they
can never be resumed from and would otherwise count). A checkpoint *newer* than the one just
committed belongs to an earlier run that this run does not continue, so it is never resumed
from nor deleted: it is moved to ``superseded-<UTC time>/``.

``checkpoint.resume: never``: the driver calls ``start_fresh()`` before the first rollout, which
moves every existing checkpoint (and ``latest``) to ``superseded-<UTC time>/``. The new run
then neither resumes from nor prunes into the old ones, and nothing is deleted; remove the
``superseded-*`` directories when they are no longer needed (they use disk space).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import NoReturn

from rlhpc.errors import RlhpcError
from rlhpc.util.files import disk_full, disk_space, fsync_dir, write_atomic

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
STATE = "trainer_state.json"
LATEST = "latest"
PREFIX = "rollout_"
STAGING = ".staging-"
SUPERSEDED = "superseded-"
CHUNK = 1 << 20  # checksum read size: large enough to run at memory speed, small enough to stay in cache


class CheckpointSaveError(RlhpcError):
    """A checkpoint could not be written (a full disk, a quota, an I/O error)."""


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


def _rollout_id(path: Path) -> int | None:
    digits = path.name[len(PREFIX) :]
    return int(digits) if path.name.startswith(PREFIX) and digits.isdigit() else None


def _sync_and_sum(path: Path, buf: bytearray) -> int:
    """fsync ``path`` and return its CRC-32 (one open, one read)."""
    crc = 0
    view = memoryview(buf)
    with open(path, "rb+", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
        os.fsync(f.fileno())
    return crc


def _manifest(root: Path, known: dict[str, tuple[int, int]] | None = None) -> dict:
    """Every file under ``root`` (but the marker) with its size and CRC-32; every file fsynced.

    ``known``: (size, CRC-32) of files their writer already fsynced and summed from memory;
    those are not read back (where the size on disk matches)."""
    sizes, sums = {}, {}
    known = known or {}
    buf = bytearray(CHUNK)
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MARKER:
            rel = p.relative_to(root).as_posix()
            size = p.stat().st_size
            if rel in known and tuple(known[rel])[0] == size:
                sums[rel] = tuple(known[rel])[1]
            else:
                sums[rel] = _sync_and_sum(p, buf)
            sizes[rel] = size
    # "files" keeps the previous version's shape (name -> size), so older code can still read it.
    return {"files": sizes, "crc32": sums}


def file_crc32(path: Path) -> int:
    crc = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def _manifest_problem(manifest: object) -> str | None:
    """What is malformed in a parsed manifest, or None."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return "manifest has no 'files' table"
    for rel, size in manifest["files"].items():
        parts = PurePosixPath(rel).parts
        if not rel or PurePosixPath(rel).is_absolute() or ".." in parts:
            return f"manifest names a path outside the checkpoint ({rel!r})"
        if type(size) is not int or size < 0:
            return f"manifest gives {rel} a size of {size!r}"
    sums = manifest.get("crc32", {})  # absent in manifests written before checksums
    if not isinstance(sums, dict) or any(type(c) is not int or rel not in manifest["files"] for rel, c in sums.items()):
        return "manifest has a malformed 'crc32' table"
    return None


def validate(path: Path, content: bool = True) -> str | None:
    """Why ``path`` is not a usable checkpoint, or None when it is.

    ``content=False`` checks presence and sizes only (cheap; retention uses it); the default also
    compares each file's CRC-32 with the manifest, where the manifest has one.
    """
    marker = path / MARKER
    if not marker.is_file():
        return f"{path.name} has no {MARKER} marker (save interrupted?)"
    try:
        manifest = json.loads(marker.read_text())
        state = json.loads((path / STATE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{path.name}: unreadable marker or state ({e})"
    problem = _manifest_problem(manifest)
    if problem:
        return f"{path.name}: malformed {MARKER} {problem}"
    if not isinstance(state, dict) or type(state.get("rollout_id")) is not int:
        return f"{path.name}: {STATE} has no rollout id"
    sums = manifest.get("crc32", {})
    for rel, size in manifest["files"].items():
        f = path / rel
        try:
            actual = f.stat().st_size if f.is_file() else None
            if actual is None:
                return f"{path.name}: missing {rel}"
            if actual != size:
                return f"{path.name}: {rel} is {actual} bytes, manifest says {size}"
            if content and rel in sums and file_crc32(f) != sums[rel]:
                return f"{path.name}: {rel} does not match its checksum in the manifest (corrupted)"
        except OSError as e:
            return f"{path.name}: cannot read {rel} ({e})"
    return None


@dataclass
class _InFlight:
    """A save whose write and commit run on a background thread."""

    rollout_id: int
    thread: threading.Thread | None = None
    checkpoint: Checkpoint | None = None
    error: BaseException | None = None
    seconds: float = 0.0


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last
        self._in_flight: _InFlight | None = None
        self.last_write_s: float | None = None  # write + commit of the last save waited for
        self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ starting

    def clean_debris(self) -> None:
        """Remove what killed saves left: staging directories and temporary ``latest`` files.

        Called by the job at its start (never by readers such as ``jobs/status.py``: a live job's
        save in progress is also a staging directory).
        """
        for p in self.root.iterdir():
            replaced = self.root / p.name.removeprefix(f"{STAGING}old-")
            if p.name.startswith(f"{STAGING}old-") and not replaced.exists() and validate(p, content=False) is None:
                # killed between the two renames of a re-save: this is the only copy of that rollout
                os.replace(p, replaced)
                log.warning("restored %s from an interrupted re-save", replaced.name)
            elif p.name.startswith(STAGING) or p.name.startswith(f".{LATEST}.tmp-"):
                log.info("removing %s left by an interrupted save", p)
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)

    def start_fresh(self) -> Path | None:
        """``resume: never``: move every checkpoint (and ``latest``) aside; where they went, or None."""
        self.clean_debris()
        old = self._checkpoint_dirs()
        if (self.root / LATEST).exists():
            old.append(self.root / LATEST)
        if not old:
            return None
        return self._set_aside(old, "checkpoint.resume is 'never': this run starts over and does not use them")

    def _set_aside(self, paths: list[Path], why: str) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dest = self.root / f"{SUPERSEDED}{stamp}"
        n = 1
        while dest.exists():
            n += 1
            dest = self.root / f"{SUPERSEDED}{stamp}-{n}"
        dest.mkdir()
        for p in paths:
            os.replace(p, dest / p.name)
        fsync_dir(self.root)
        log.warning(
            "checkpoints %s moved to %s: %s. rlhpc never reads or removes them; delete that directory "
            "when you no longer need it",
            ", ".join(p.name for p in paths),
            dest,
            why,
        )
        return dest

    # ------------------------------------------------------------ saving

    def stage(self, rollout_id: int) -> Path:
        """A fresh, empty directory for the writers of checkpoint ``rollout_id``."""
        staging = self.root / f"{STAGING}{checkpoint_name(rollout_id)}"
        if staging.exists():  # left over from a save that was killed
            shutil.rmtree(staging)
        staging.mkdir()
        return staging

    def save(self, rollout_id: int, write: Callable[[Path], object], state: dict) -> Checkpoint:
        """Stage, let ``write`` fill the staging directory, commit; a failed save leaves nothing behind."""
        self.save_async(rollout_id, lambda staging: lambda: write(staging), state, background=False)
        return self.wait()

    def save_async(
        self,
        rollout_id: int,
        snapshot: Callable[[Path], Callable[[], object]],
        state: dict,
        background: bool = True,
    ) -> None:
        """Stage; ``snapshot(staging)`` runs now and returns the rest of the write, which runs on a
        background thread and is followed by the commit. The write may return the (size, CRC-32)
        of files it fsynced and summed itself (by path relative to the staging directory).

        The caller waits only for ``snapshot``. At most one save is in flight: this first waits
        for the previous one to commit (raising its error, if it failed). ``wait`` returns the
        committed checkpoint or raises why the save failed; either way nothing half-written is
        left behind, and the previous checkpoint stays valid until the new one is committed.
        """
        self.wait()
        staging = None
        try:
            staging = self.stage(rollout_id)
            finish = snapshot(staging)
        except BaseException as e:
            self._abandon(rollout_id, staging, e)
        job = _InFlight(rollout_id)
        self._in_flight = job
        if background:
            job.thread = threading.Thread(
                target=self._write_and_commit, args=(job, staging, finish, state), name=f"checkpoint-{rollout_id}"
            )
            job.thread.start()
        else:
            self._write_and_commit(job, staging, finish, state)

    def _write_and_commit(self, job: _InFlight, staging: Path, finish: Callable[[], object], state: dict) -> None:
        start = time.perf_counter()
        try:
            try:
                known = finish()
            except BaseException as e:
                self._abandon(job.rollout_id, staging, e)
            job.checkpoint = self.commit(staging, job.rollout_id, state, known if isinstance(known, dict) else None)
        except BaseException as e:  # raised to the caller of wait()
            job.error = e
        job.seconds = time.perf_counter() - start

    @property
    def in_flight(self) -> int | None:
        """The rollout id of the save not yet waited for, or None."""
        return self._in_flight.rollout_id if self._in_flight is not None else None

    def wait(self) -> Checkpoint | None:
        """Wait for the save in flight to commit; the checkpoint (None if there was no save in
        flight), or the save's error. ``last_write_s`` is then how long its write + commit took."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return None
        if job.thread is not None:
            job.thread.join()
        self.last_write_s = job.seconds
        if job.error is not None:
            raise job.error
        return job.checkpoint

    def collect(self) -> float | None:
        """Without blocking: ``wait`` for the save in flight if it has finished (raising its
        error); the write + commit seconds of the save waited for since the last call, or None."""
        job = self._in_flight
        if job is not None and (job.thread is None or not job.thread.is_alive()):
            self.wait()
        seconds, self.last_write_s = self.last_write_s, None
        return seconds

    def _abandon(self, rollout_id: int, staging: Path | None, e: BaseException) -> NoReturn:
        """A save failed before its commit: remove its staging directory, raise a clear error."""
        # Measured before the cleanup frees space: the error shows the full disk as it was.
        err = self._save_failed(rollout_id, e) if isinstance(e, OSError) else None  # Ray wraps OSErrors as OSErrors
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if err is not None:
            raise err from e
        raise e

    def commit(
        self, staging: Path, rollout_id: int, state: dict, known: dict[str, tuple[int, int]] | None = None
    ) -> Checkpoint:
        """Seal a staged checkpoint: state, fsync + checksums, manifest, rename, ``latest``, retention.
        ``known``: (size, CRC-32) by relative path of files already fsynced and summed by their writer.

        On an error before the rename the staging directory is removed and the previous
        checkpoints are untouched.
        """
        state = {**state, "rollout_id": rollout_id}
        final = self.root / checkpoint_name(rollout_id)
        try:
            (staging / STATE).write_text(json.dumps(state, indent=1))
            manifest = {"rollout_id": rollout_id, **_manifest(staging, known)}
            write_atomic(staging / MARKER, json.dumps(manifest, indent=1))
            if final.exists():  # the same rollout saved again after a resume: replace it whole
                trash = self.root / f"{STAGING}old-{final.name}"
                shutil.rmtree(trash, ignore_errors=True)
                os.replace(final, trash)
                os.replace(staging, final)
                shutil.rmtree(trash)
            else:
                os.replace(staging, final)
            fsync_dir(self.root)
        except OSError as e:
            err = self._save_failed(rollout_id, e)
            shutil.rmtree(staging, ignore_errors=True)
            raise err from e
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        try:
            write_atomic(self.root / LATEST, final.name + "\n")
        except OSError as e:  # the checkpoint itself is complete; resume does not need the pointer
            log.warning("checkpoint %s saved, but %s was not updated: %s; %s", final, LATEST, e, disk_space(self.root))
        self._retain(final, rollout_id)
        log.info("checkpoint %s saved", final)
        return Checkpoint(final, rollout_id, state)

    def _save_failed(self, rollout_id: int, e: BaseException) -> CheckpointSaveError:
        previous = self.latest(content=False)
        kept = (
            f"the previous checkpoint {previous.path.name} is intact and a resubmission resumes from it"
            if previous
            else "there is no earlier checkpoint: a resubmission starts the run over"
        )
        fix = (
            "free space on that filesystem (or raise the quota), or use a run dir on one with room"
            if disk_full(e)
            else f"check that {self.root} is writable and its filesystem healthy"
        )
        return CheckpointSaveError(
            f"saving the checkpoint of rollout {rollout_id} failed: {e}; {disk_space(self.root)}", f"{fix}; {kept}"
        )

    def _retain(self, committed: Path, rollout_id: int) -> None:
        """Keep the committed checkpoint and the newest valid older ones, ``keep_last`` in all."""
        dirs = self._checkpoint_dirs()
        newer = [p for p in dirs if _rollout_id(p) > rollout_id]
        if newer:
            self._set_aside(newer, f"they are newer than {committed.name}, which this run just saved")
        kept = 1
        for old in reversed([p for p in dirs if _rollout_id(p) < rollout_id]):
            reason = validate(old, content=False)
            if reason is None and kept < self.keep_last:
                kept += 1
                continue
            shutil.rmtree(old)
            log.info("checkpoint %s removed (%s)", old.name, reason or f"keep_last={self.keep_last}")

    # ------------------------------------------------------------ resuming

    def _checkpoint_dirs(self) -> list[Path]:
        """Checkpoint directories in rollout order (validity not checked)."""
        dirs = [p for p in self.root.iterdir() if p.is_dir() and _rollout_id(p) is not None]
        return sorted(dirs, key=_rollout_id)

    def oldest(self) -> int | None:
        """The rollout id of the oldest checkpoint directory (valid or not), or None: no resume
        goes back past it."""
        dirs = self._checkpoint_dirs()
        return _rollout_id(dirs[0]) if dirs else None

    def latest(self, content: bool = True) -> Checkpoint | None:
        """The newest valid checkpoint. Falls back past damaged ones, with a warning.

        Directories are validated rather than trusting ``latest``: a crash between the rename
        and the pointer update leaves a newer complete checkpoint that is safe to use.
        ``content=False`` skips the checksums (for tools that only report where a run stands).
        """
        for path in reversed(self._checkpoint_dirs()):
            reason = validate(path, content)
            if reason is None:
                state = json.loads((path / STATE).read_text())
                return Checkpoint(path, state["rollout_id"], state)
            log.warning("skipping checkpoint: %s; falling back to an older one", reason)
        return None
