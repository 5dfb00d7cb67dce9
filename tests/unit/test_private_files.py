"""Dirs and files rlhpc makes for itself are private, and nothing another user made is trusted
(issue 32, items 1 and 2): the checks, with the other user real (``tests.support.other_user``)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from support.other_user import make_as_other_user, run_as_other_user, shared_tmp_dir

from rlhpc.errors import RlhpcError
from rlhpc.util.files import apply_access, private_dir, read_trusted_json


@pytest.fixture
def sticky_root():
    with shared_tmp_dir() as root:
        yield root


def test_a_private_dir_is_made_0700_whatever_the_umask(sticky_root: Path) -> None:
    old = os.umask(0)
    try:
        d = private_dir(sticky_root / "job")
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.stat().st_uid == os.getuid()


def test_one_of_ours_left_wide_is_made_private_and_emptied_when_fresh(sticky_root: Path) -> None:
    d = sticky_root / "job"
    d.mkdir()
    d.chmod(0o777)
    (d / "left").write_text("by an earlier start")
    private_dir(d, fresh=True)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and list(d.iterdir()) == []


def test_a_dir_another_user_made_first_is_refused_not_used(sticky_root: Path) -> None:
    squat = sticky_root / "rlhpc-4242-0"
    make_as_other_user(str(squat))
    with pytest.raises(RlhpcError, match="another user") as e:
        private_dir(squat, fresh=True)
    assert "rm -rf" in e.value.fix
    assert squat.stat().st_uid != os.getuid()  # left as it was: not ours to remove


def test_a_link_in_its_place_is_refused(sticky_root: Path, tmp_path: Path) -> None:
    (sticky_root / "job").symlink_to(tmp_path)
    with pytest.raises(RlhpcError, match="a link"):
        private_dir(sticky_root / "job")


def test_a_parent_others_can_rename_in_is_refused(sticky_root: Path) -> None:
    open_parent = sticky_root / "open"
    make_as_other_user(str(open_parent), 0o777)  # not ours, writable by all, no sticky bit
    with pytest.raises(RlhpcError, match="sticky"):
        private_dir(open_parent / "job")


def test_a_ready_file_not_naming_our_process_or_not_ours_is_refused(tmp_path: Path, sticky_root: Path) -> None:
    ready = tmp_path / "ready.json"
    ready.write_text(json.dumps({"host": "127.0.0.1", "port": 1, "pid": 123}))
    assert read_trusted_json(ready, pid=123)["port"] == 1
    with pytest.raises(RlhpcError, match="does not name the process"):
        read_trusted_json(ready, pid=124)
    link = tmp_path / "link.json"
    link.symlink_to(ready)
    with pytest.raises(OSError):
        read_trusted_json(link, pid=123)  # O_NOFOLLOW: a link put in its place is not followed
    planted = sticky_root / "r.json"
    out = run_as_other_user(
        "import json, sys; open(sys.argv[1], 'w').write(json.dumps({'port': 2, 'pid': 123}))", str(planted)
    )
    assert out.returncode == 0, out.stderr
    with pytest.raises(RlhpcError, match="another user wrote it"):
        read_trusted_json(planted, pid=123)


def test_run_dir_access_private_or_shared_with_the_group(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        for access, dir_mode, file_mode in (("private", 0o700, 0o600), ("group", 0o750, 0o640)):
            run = tmp_path / access
            run.mkdir(mode=0o755)
            apply_access(run, access)
            (run / "ckpt").mkdir()
            (run / "ckpt" / "state.pt").write_bytes(b"x")
            assert stat.S_IMODE(run.stat().st_mode) == dir_mode == stat.S_IMODE((run / "ckpt").stat().st_mode)
            assert stat.S_IMODE((run / "ckpt" / "state.pt").stat().st_mode) == file_mode
    finally:
        os.umask(old)
