"""Files written so readers never see half of them; for error messages, the end of a log and how
full a filesystem is."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from rlhpc.errors import RlhpcError

# The node-local dir of the job task that started this node's Ray (set in Ray's environment, so
# every Ray worker sees it); the task removes it when it ends, whatever happened to the workers.
NODE_TMP_ENV = "RLHPC_NODE_TMP"


UMASKS = {"private": 0o077, "group": 0o027}  # Config.run_dir_access -> what every file of the run gets


def apply_access(run_dir: Path, access: str) -> None:
    """Every file this process (and what it starts) makes from here on, and the run dir itself,
    as ``access`` says: the run's data is the user's, private unless shared with the group."""
    os.umask(UMASKS[access])
    if os.path.isdir(run_dir):
        os.chmod(run_dir, 0o777 & ~UMASKS[access])  # a run dir of an earlier start, or made by the user


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old content or the new, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave the temporary file behind
        raise
    fsync_dir(path.parent)


def tail(path: Path, n: int = 30) -> str:
    """The last ``n`` lines of a log, for an error message ("(no log)" if it cannot be read)."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def private_dir(path: Path, fresh: bool = False) -> Path:
    """``path`` as a dir only this user can enter: made 0700 when missing, emptied first when
    ``fresh``; refused when it is a link, not a dir, or another user's (who could then read,
    swap or plant what we write there), or when its parent lets others rename it away.

    The mode is checked after creation: ``mkdir``'s mode is only ever narrowed by the umask, but
    a dir of ours left by an earlier job may be wider, and is made private again."""
    path = Path(path)
    parent = os.stat(path.parent)
    if parent.st_uid != os.getuid() and parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX:
        raise RlhpcError(
            f"{path.parent} is writable by other users and has no sticky bit: they could rename {path.name} away "
            "and put their own in its place",
            f"use a parent dir only you can write, or make it sticky (chmod +t {path.parent}) as /tmp is",
        )
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        _require_ours(path)
        if fresh:
            shutil.rmtree(path)
            os.mkdir(path, 0o700)
    os.chmod(path, 0o700, follow_symlinks=False)
    _require_ours(path)
    if stat.S_IMODE(os.lstat(path).st_mode) != 0o700:
        raise RlhpcError(f"{path} is not mode 0700 after chmod", f"check the filesystem holding {path} keeps modes")
    return path


def _require_ours(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        what = "a link" if stat.S_ISLNK(st.st_mode) else "not a dir" if not stat.S_ISDIR(st.st_mode) else "a dir"
        raise RlhpcError(
            f"{path} already exists and is {what} of uid {st.st_uid}, not of this user (uid {os.getuid()}): "
            "another user may have made it to read or replace what rlhpc writes there",
            f"remove it (its owner or root can: rm -rf {path}), or run where that path is free",
        )


def remove_if_ours(path: Path) -> bool:
    """Remove ``path`` (a dir with what is in it, or a file) when it is this user's own and not a
    link; whether it was. In a dir others can write (a shared stage dir, /tmp) a name may be
    another user's: a link of theirs is never followed (its target's owner proves nothing), and
    what is theirs is left alone, not an error. Absent is fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if st.st_uid != os.getuid() or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)  # fd-based where the platform has it: links inside are not followed
    else:
        Path(path).unlink(missing_ok=True)
    return True


def read_trusted_json(path: Path, pid: int | None = None) -> dict[str, Any]:
    """A small JSON file one of our processes wrote (a server's ready file): opened without
    following a link, refused unless this user owns it and, with ``pid``, it names that process."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        owner = os.fstat(f.fileno()).st_uid
        text = f.read()
    if owner != os.getuid():
        raise RlhpcError(
            f"{path} belongs to uid {owner}, not to this user: another user wrote it",
            f"find who can write to {path.parent}; rlhpc makes that dir 0700",
        )
    info = json.loads(text)
    if not isinstance(info, dict) or (pid is not None and info.get("pid") != pid):
        raise RlhpcError(
            f"{path} does not name the process we started (pid {pid}): {text[:200]!r}",
            f"find who can write to {path.parent}; rlhpc makes that dir 0700",
        )
    return info


def ray_temp_dir(node_tmp: Path) -> Path:
    """Ray's temp dir inside a task's private node-local dir: Ray makes its own dirs 0777 (its
    sessions, sockets, logs), so only a private dir above them keeps other users out."""
    return Path(node_tmp) / "ray"


def node_tmp_dir(prefix: str) -> Path:
    """A new private dir in the task's node-local dir (``NODE_TMP_ENV``), else in the system's
    temp dir: a Ray worker killed with its files open leaves nothing behind the task's end."""
    root = os.environ.get(NODE_TMP_ENV)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root if root and os.path.isdir(root) else None))


def mount_point(path: Path) -> Path:
    path = Path(path).resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def disk_space(path: Path) -> str:
    """Which filesystem holds ``path`` and how full it is, for an error message."""
    try:
        st = os.statvfs(path)
    except OSError:
        return f"the filesystem holding {path} cannot be queried"
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return f"the filesystem mounted at {mount_point(path)} (holding {path}) has {free} bytes free of {total}"


def disk_full(e: BaseException) -> bool:
    """``e`` says the filesystem (or the quota) is full; Ray passes a rank's error on as text."""
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e)
