"""Staged start: the base model and the checkpoint resumed from, copied to each node's own disk.

Without it every start has every rank and engine on every node read the same files from the
shared filesystem at once. With ``cluster.stage_dir`` (a node-local path, ``$VARS`` expanded on
the node), each node's task copies them once to ``<stage_dir>/rlhpc-<job id>/`` before its Ray
node starts, so before anything can load them (the driver starts engines and ranks only once
every node joined Ray); the driver is handed the staged paths and each task removes its copy
when it ends. How: ``sbcast`` where the cluster has it (Slurm's own tree broadcast: the shared
filesystem is read once, by task 0), else every node copies in parallel. A replacement node
(``NodeWatch``) stages the model the same way before its Ray worker joins (``STAGING_FILE``).

Copies are atomic (a temp dir renamed into place, a manifest of the source's files inside it),
so tasks that share one disk, as the minicluster's nodes do, stage once between them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import tarfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rlhpc.config import ClusterConfig
from rlhpc.errors import RlhpcError
from rlhpc.util.files import private_dir, remove_if_ours

log = logging.getLogger(__name__)

MANIFEST = ".rlhpc-staged.json"
STAGING_FILE = "staging.json"  # in the job's Ray state dir: what a replacement node stages
COPY_THREADS = 8  # parallel filesystems serve several streams faster than one


@dataclass(frozen=True)
class Staged:
    """Where this node's copies are: ``paths`` maps a source dir to its staged copy."""

    root: Path | None = None
    paths: dict[str, str] = field(default_factory=dict)

    def get(self, path: str | Path) -> str:
        """The staged copy of ``path``, or ``path`` itself when it was not staged."""
        return self.paths.get(str(path), str(path))

    def remove(self) -> None:
        if self.root is not None:
            remove_if_ours(self.root)
            remove_if_ours(_archive(self.root))  # beside the root, in a dir others may write to
            log.info("removed the staged copies in %s", self.root)


NOT_STAGED = Staged()


def use_sbcast(cluster: ClusterConfig, kind: str, num_nodes: int) -> bool:
    """sbcast for a homogeneous Slurm job (``kind``: the backend, slurm or local) of several nodes where the tool exists (``stage_with``)."""
    if cluster.stage_with == "copy" or kind != "slurm" or num_nodes < 2 or cluster.heterogeneous:
        return False  # a het job's components stage different things: each node copies its own
    return cluster.stage_with == "sbcast" or shutil.which("sbcast") is not None


def stage_root(stage_dir: str, job_id: str) -> Path:
    return Path(os.path.expandvars(stage_dir)).expanduser() / f"rlhpc-{job_id}"


def remove_stale(root: Path, alive: Callable[[str], bool | None]) -> None:
    """Remove what killed jobs of this user left beside ``root`` (a SIGKILL skips the removal at
    the end): every other ``rlhpc-JOB`` dir and archive of this user whose job ``alive`` says has
    ended. The stage dir may be shared (/tmp): a name there may be another user's, or a link
    (dangling, or to a dir of ours); neither is followed, trusted or removed (issue 43, item 5)."""
    for other in root.parent.glob("*rlhpc-*"):
        job = other.name.lstrip(".").removeprefix("rlhpc-").split(".")[0]
        if other.name.lstrip(".").split(".")[0] == root.name or not _ours(other):
            continue
        if alive(job) is False and remove_if_ours(other):
            log.info("removed %s, left by job %s of this user, which has ended", other, job)


def _ours(path: Path) -> bool:
    """``path`` is this user's own dir or file, not a link (its own owner, not its target's)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return st.st_uid == os.getuid() and (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode))


def plan(root: Path, model: str, checkpoint: str | None) -> dict[str, str]:
    """Source dir -> its staged path: the model under ``model/``, a checkpoint under its own name."""
    paths = {str(model): str(root / "model")}
    if checkpoint is not None:
        paths[str(checkpoint)] = str(root / "checkpoints" / Path(checkpoint).name)
    return paths


def manifest(src: Path) -> list[list]:
    """Every file of ``src`` with its size and mtime: a staged copy is current when they match."""
    return sorted(
        [str(p.relative_to(src)), p.stat().st_size, p.stat().st_mtime_ns] for p in src.rglob("*") if p.is_file()
    )


def is_current(dst: Path, src_manifest: list[list]) -> bool:
    try:
        return json.loads((dst / MANIFEST).read_text()) == src_manifest
    except (OSError, ValueError):
        return False


def stage(paths: dict[str, str], root: Path, broadcast: Broadcast | None = None) -> Staged:
    """Copy every source dir of ``paths`` to its staged path on this node. ``broadcast``: this is
    task 0 of a Slurm job with sbcast, which sends one archive of them to every node of the job,
    says so in ``broadcast.done`` and unpacks its own (the other tasks: ``receive``)."""
    manifests = {src: manifest(Path(src)) for src in paths}  # one walk of each source
    root = _check_disk(root, sum(size for m in manifests.values() for _, size, _ in m))
    for old in (root / "checkpoints").glob("*"):  # left by an earlier start of this job that was killed
        # not a dot-named temp dir: another task on this disk may be copying into it right now
        if not old.name.startswith(".") and str(old) not in paths.values():
            shutil.rmtree(old, ignore_errors=True)
    began = time.monotonic()
    if broadcast is not None:
        broadcast.done.parent.mkdir(parents=True, exist_ok=True)
        archive = root / ".src.tar"  # in our private root: beside it, in a shared dir, a name may be a link
        try:
            with tarfile.open(archive, "w") as tar:  # uncompressed: model weights do not compress
                for k, src in enumerate(paths):
                    tar.add(src, arcname=str(k))
            _sbcast(archive, _archive(root), broadcast.job_id)
        except BaseException as e:
            broadcast.done.write_text(f"failed: {e}\n")  # the other tasks stop waiting
            raise
        finally:
            archive.unlink(missing_ok=True)
        broadcast.done.write_text("ok\n")
        _unpack(paths, root, manifests)
    else:
        for src, dst in paths.items():
            _copy_dir(Path(src), Path(dst), manifests[src])
    log.info(
        "staged %s in %s (%.1f s, %s)",
        ", ".join(Path(s).name for s in paths),
        root,
        time.monotonic() - began,
        "sbcast to every node" if broadcast else "copied on this node",
    )
    return Staged(root, dict(paths))


@dataclass(frozen=True)
class Broadcast:
    """An sbcast of the staged inputs by task 0 to every node of job ``job_id``; ``done`` (on the
    shared filesystem) says when it is over: "ok", or "failed: why"."""

    job_id: str
    done: Path


def receive(paths: dict[str, str], root: Path, broadcast: Broadcast, timeout_s: float = 3600.0) -> Staged:
    """A node's share of task 0's sbcast: wait until it is over, unpack the archive into place."""
    deadline = time.monotonic() + timeout_s
    while not broadcast.done.is_file():
        if time.monotonic() > deadline:
            raise RlhpcError(
                f"task 0's sbcast of the staged inputs did not end within {timeout_s:.0f}s", "see task 0's log"
            )
        time.sleep(0.5)
    word = broadcast.done.read_text().strip()
    if word != "ok":
        raise RlhpcError(f"task 0's sbcast of the staged inputs {word}", "see task 0's log")
    _unpack(paths, root, {src: manifest(Path(src)) for src in paths})
    log.info("staged %s in %s (task 0's sbcast, unpacked here)", ", ".join(Path(s).name for s in paths), root)
    return Staged(root, dict(paths))


def _archive(root: Path) -> Path:
    """Where sbcast puts the archive on every node: beside the stage root (sbcast makes no dirs)."""
    return root.parent / f".{root.name}.tar"


def _unpack(paths: dict[str, str], root: Path, manifests: dict[str, list[list]]) -> None:
    if all(is_current(Path(d), manifests[s]) for s, d in paths.items()):
        return  # another task on this disk unpacked it first
    tmp = root / f".unpack-{socket.gethostname()}-{os.getpid()}"
    try:
        # beside the root, where sbcast can put it: only a file of ours, and not through a link
        fd = os.open(_archive(root), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            if os.fstat(f.fileno()).st_uid != os.getuid():
                raise RlhpcError(
                    f"{_archive(root)} belongs to another user: it is not task 0's sbcast of this job",
                    "remove it (its owner or root can), or set cluster.stage_dir to a dir only you can write",
                )
            with tarfile.open(fileobj=f) as tar:
                tar.extractall(tmp, filter="data")
        for k, (src, dst) in enumerate(paths.items()):
            (tmp / str(k) / MANIFEST).write_text(json.dumps(manifests[src]))
            _move_into_place(tmp / str(k), Path(dst), manifests[src])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # the archive stays until the end: another task on this disk may still unpack it


def _sbcast(src: Path, dst: Path, job_id: str) -> None:
    cmd = ["sbcast", "--force", f"--jobid={job_id}", str(src), str(dst)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RlhpcError(
            f"sbcast of the staged inputs failed: {out.stderr.strip() or out.returncode}",
            "check that the stage_dir exists and is writable on every node, or set cluster.stage_with: copy "
            "(or cluster.stage_dir: null)",
        )


def _copy_dir(src: Path, dst: Path, src_manifest: list[list]) -> None:
    if is_current(dst, src_manifest):  # staged by another task on this disk, or by an earlier start
        return
    tmp = dst.with_name(f".{dst.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    files = [rel for rel, _, _ in src_manifest]
    for d in {(tmp / rel).parent for rel in files} | {tmp}:
        d.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(COPY_THREADS) as pool:
        list(pool.map(lambda rel: shutil.copy2(src / rel, tmp / rel), files))
    (tmp / MANIFEST).write_text(json.dumps(src_manifest))
    _move_into_place(tmp, dst, src_manifest)


def _move_into_place(tmp: Path, dst: Path, src_manifest: list[list]) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() and not is_current(dst, src_manifest):
        shutil.rmtree(dst, ignore_errors=True)  # left by an earlier start, of other content
    try:
        tmp.rename(dst)
    except OSError:
        if not is_current(dst, src_manifest):  # not merely another task on this disk first
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _check_disk(root: Path, need: int) -> Path:
    """Make the stage root; refuse, naming the filesystem, when ``need`` bytes would not fit."""
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        # Ours and private: a copy in a dir another user made, or could write to, may be theirs
        # (job ids are sequential: they can plant one for the next job's path).
        private_dir(root)
    except RlhpcError:
        raise
    except OSError as e:
        raise RlhpcError(
            f"cannot create the stage dir {root} on {socket.gethostname()}: {e}",
            "set cluster.stage_dir to a node-local path this user can write (e.g. /tmp or $TMPDIR), or null",
        ) from e
    free = shutil.disk_usage(root).free
    if need > free:
        with contextlib.suppress(OSError):
            root.rmdir()  # nothing was staged: leave nothing behind
        raise RlhpcError(
            f"staging needs {need / 2**30:.2f} GiB but the filesystem of {root} on {socket.gethostname()} has "
            f"{free / 2**30:.2f} GiB free",
            "set cluster.stage_dir to a node-local path with room for the model and a checkpoint, or null",
        )
    return root


def write_plan(state_root: Path, root: Path, paths: dict[str, str]) -> None:
    """For replacement nodes: what this job stages (the model only: they serve engines)."""
    model = {s: d for s, d in paths.items() if Path(d).name == "model"}
    state_root.mkdir(parents=True, exist_ok=True)
    (state_root / STAGING_FILE).write_text(json.dumps({"root": str(root), "paths": model}))


def stage_replacement(state_root: Path) -> Staged:
    """A replacement node: stage what the job's plan says, by copying (sbcast serves the job's own nodes)."""
    try:
        spec = json.loads((state_root / STAGING_FILE).read_text())
    except FileNotFoundError:
        return NOT_STAGED
    return stage(spec["paths"], Path(spec["root"]))
