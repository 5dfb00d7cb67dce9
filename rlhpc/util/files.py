"""Files written so readers never see half of them; for error messages, the end of a log and how
full a filesystem is."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

# The node-local dir of the job task that started this node's Ray (set in Ray's environment, so
# every Ray worker sees it); the task removes it when it ends, whatever happened to the workers.
NODE_TMP_ENV = "RLHPC_NODE_TMP"


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
