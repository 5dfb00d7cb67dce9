"""A second, unprivileged user on the same machine: the attacker of the two-user tests (issue 32).

Its code runs under the system's python3 (stdlib only: the test's venv may not be readable by
that uid) as ``nobody`` with no groups, via ``setpriv``; tests need root to switch to it, as CI has.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

UID = 65534  # nobody


def require_second_user() -> None:
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("a second user needs root and setpriv (CI has both)")


def run_as_other_user(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run Python ``code`` (with ``args`` as sys.argv[1:]) as the other user; its output comes back."""
    require_second_user()
    cmd = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "/usr/bin/python3", "-c", code, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd="/", check=False)


def make_as_other_user(path: str, mode: int = 0o777) -> None:
    """``path`` made first by the other user (a dir, ``mode``), as a squatter on a predictable name would."""
    out = run_as_other_user(
        "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], int(sys.argv[2]))", path, str(mode)
    )
    assert out.returncode == 0, out.stderr


@contextlib.contextmanager
def shared_tmp_dir() -> Iterator[Path]:
    """A world-writable sticky dir under /tmp, as /tmp itself (pytest's tmp_path is 0700: the
    other user could not reach into it), removed after."""
    root = Path(tempfile.mkdtemp(prefix="rlhpc-t-"))
    root.chmod(0o1777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_as_other_user_in_background(code: str) -> subprocess.Popen:
    """Python ``code`` as the other user, left running (the caller kills it); returns once the
    process runs as that user (setpriv switches before it execs)."""
    require_second_user()
    cmd = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "/usr/bin/python3", "-c", code]
    proc = subprocess.Popen(cmd, cwd="/")
    deadline = time.monotonic() + 10
    while psutil.Process(proc.pid).uids().real != UID:
        assert time.monotonic() < deadline and proc.poll() is None, "the other user's process did not start"
        time.sleep(0.01)
    return proc


READ_EACH = r"""
import json, os, sys
out = {}
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read()
        out[path] = "read"
    except OSError as e:
        out[path] = type(e).__name__
print(json.dumps(out))
"""


def what_the_other_user_reads(*paths: Path) -> dict[str, str]:
    """The other user tries to read each path (a dir: to list it): "read" or the error it got."""
    import json

    out = run_as_other_user(READ_EACH, *map(str, paths))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
