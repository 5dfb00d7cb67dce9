"""A small filesystem to fill for real: a tmpfs of a given size (needs root and mount)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[bool]:
    """Mount a tmpfs of ``size`` (mount's spelling: "1m") at ``path`` (made here) for the block;
    yields whether it could (not root, or no mount: False, and ``path`` is a plain directory)."""
    path.mkdir()
    mounted = (
        os.geteuid() == 0
        and shutil.which("mount") is not None
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=True)
