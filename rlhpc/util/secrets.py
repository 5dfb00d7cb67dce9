"""Per-job secrets (the Ray token, the engine key): random, in a file only the owner can read.

A secret travels by file path, never by value on a command line (``ps`` shows those to every
user of the node) nor in a log; the file is 0600 from its first byte (created with that mode,
then renamed into place, so no reader ever sees a wider mode or half a secret).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from rlhpc.util.files import fsync_dir


def new_secret() -> str:
    return secrets.token_hex(32)


def write_secret(path: Path, value: str | None = None) -> str:
    """Write ``value`` (a fresh random one when None) to ``path`` as a 0600 file; return it."""
    path = Path(path)
    value = new_secret() if value is None else value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(value)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return value


def read_secret(path: str | Path) -> str:
    return Path(path).read_text().strip()


def constant_time_equal(given: str, expected: str) -> bool:
    return secrets.compare_digest(given.encode(), expected.encode())
