"""The per-job engine key: every engine route (CPU engine server, SGLang, the router) requires it.

Sent as SGLang does: ``Authorization: Bearer KEY``. The key lives in a 0600 file
(``RunDir.engine_key``, rewritten at every start of the job); processes get the file's path,
never the key on their command line. Routes and what each may do are in ``protocol.py``.
"""

from __future__ import annotations

from pathlib import Path

from rlhpc.util.secrets import constant_time_equal, read_secret, write_secret

HEADER = "Authorization"
SCHEME = "Bearer"


def new_key(path: Path) -> str:
    """A fresh random key in ``path`` (0600); returns it."""
    return write_secret(path)


def read_key(path: str | Path) -> str:
    return read_secret(path)


def auth_headers(key: str | None) -> dict[str, str]:
    return {HEADER: f"{SCHEME} {key}"} if key else {}


def authorized(header: str | None, key: str) -> bool:
    """Does an ``Authorization`` header carry ``key``? (constant time in the key's bytes)"""
    if not header:
        return False
    scheme, _, given = header.partition(" ")
    return scheme.lower() == SCHEME.lower() and constant_time_equal(given.strip(), key)
