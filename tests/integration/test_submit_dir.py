"""A job submitted from a dir other users can write runs none of their code (issue 43, item 6),
and no name of a local job's node-local dir can be made first by another user (item 12)."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import pytest
from support.jobs import said, submit
from support.other_user import require_second_user, run_as_other_user, shared_tmp_dir

from rlhpc.devtools import attacks
from rlhpc.run_dir import RunDir

pytestmark = pytest.mark.ray


def test_a_job_submitted_from_a_dir_others_write_runs_none_of_their_code(tmp_path: Path) -> None:
    require_second_user()
    run = tmp_path / "run"
    # The local Ray's dir was /tmp/rlhpc-ray-<digest of the run dir>, a name anyone could make first.
    squatted = Path(tempfile.gettempdir()) / f"rlhpc-ray-{hashlib.sha256(str(run).encode()).hexdigest()[:12]}"
    with shared_tmp_dir() as shared:
        # the modules the driver, the engine servers and Ray's workers import, each noting where it ran
        planted = attacks.run("cwd_plant", str(shared), *attacks.CWD_PLANT_NAMES)
        assert set(planted["steps"].values()) == {"done"}, planted
        squat = run_as_other_user("import os, sys; os.mkdir(sys.argv[1], 0o700)", str(squatted))
        try:
            assert squat.returncode == 0, squat.stderr
            p = submit(run, "rollout.num_rollout=1", cwd=shared)
            ran = (shared / "ran").read_text()
        finally:
            run_as_other_user("import shutil, sys; shutil.rmtree(sys.argv[1])", str(squatted))
    assert p.returncode == 0, said(p)[-3000:]
    assert ran == "", ran  # not one process of the job imported a module from the dir it was submitted from
    assert RunDir(run).is_finished()
    ray_dir = RunDir(run).local_ray_dir
    assert ray_dir is not None and ray_dir != squatted and not ray_dir.exists()  # its own name, gone at the end
