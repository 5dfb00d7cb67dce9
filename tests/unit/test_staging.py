"""Staged start (rlhpc/runtime/staging.py): copies are whole, current, shared by tasks on one disk,
refused before anything is written when they would not fit, and gone at the end."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
from support.disks import small_tmpfs
from support.other_user import run_as_other_user, shared_tmp_dir

from rlhpc.config import ClusterConfig
from rlhpc.errors import ConfigError, RlhpcError
from rlhpc.runtime import staging


def make_source(path: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != staging.MANIFEST
    }


@pytest.fixture
def sources(tmp_path: Path) -> tuple[Path, Path]:
    model = make_source(
        tmp_path / "shared" / "base_model", {"config.json": b"{}", "model.safetensors": os.urandom(4096)}
    )
    ckpt = make_source(tmp_path / "shared" / "checkpoints" / "rollout_000009", {"rank_0/state.pt": os.urandom(2048)})
    return model, ckpt


def test_stage_copies_both_and_remove_leaves_nothing(tmp_path, sources):
    model, ckpt = sources
    root = staging.stage_root(str(tmp_path / "local"), "77")
    staged = staging.stage(staging.plan(root, str(model), str(ckpt)), root)
    assert staged.get(model) == str(root / "model") and tree(root / "model") == tree(model)
    assert staged.get(ckpt) == str(root / "checkpoints" / "rollout_000009") and tree(Path(staged.get(ckpt))) == tree(
        ckpt
    )
    assert staged.get("/elsewhere") == "/elsewhere"  # what was not staged is read where it is
    staged.remove()
    assert not root.exists() and list((tmp_path / "local").iterdir()) == []


def test_a_current_copy_is_kept_and_a_changed_source_copied_again(tmp_path, sources):
    model, _ = sources
    root = tmp_path / "local" / "rlhpc-1"
    paths = staging.plan(root, str(model), None)
    staging.stage(paths, root)
    marker = root / "model" / "kept"
    marker.write_text("a file the second stage would remove if it copied again")
    staging.stage(paths, root)  # an earlier start's copy, still current (a requeue onto the same node)
    assert marker.exists()
    (model / "model.safetensors").write_bytes(os.urandom(100))  # another model under the same path
    staging.stage(paths, root)
    assert not marker.exists() and tree(root / "model") == tree(model)


def test_an_earlier_starts_checkpoint_is_removed(tmp_path, sources):
    model, ckpt = sources
    root = tmp_path / "local" / "rlhpc-1"
    old = make_source(root / "checkpoints" / "rollout_000004", {"x": b"old"})
    staging.stage(staging.plan(root, str(model), str(ckpt)), root)
    assert not old.exists() and (root / "checkpoints" / "rollout_000009").is_dir()


def test_another_tasks_copy_in_progress_is_left_alone(tmp_path, sources):
    model, ckpt = sources
    root = tmp_path / "local" / "rlhpc-1"
    busy = make_source(root / "checkpoints" / ".rollout_000009.tmp-node1-4242", {"part": b"being copied"})
    staging.stage(staging.plan(root, str(model), str(ckpt)), root)
    assert busy.is_dir()  # deleting it under the other task failed that task's copy (seen: 1 in ~40 runs)


def _stage_in_child(paths: dict[str, str], root: str) -> None:
    staging.stage(paths, Path(root))


def test_tasks_sharing_one_disk_stage_once_between_them(tmp_path, sources):
    model, ckpt = sources
    root = tmp_path / "local" / "rlhpc-5"
    paths = staging.plan(root, str(model), str(ckpt))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_stage_in_child, args=(paths, str(root))) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert tree(root / "model") == tree(model) and tree(root / "checkpoints" / "rollout_000009") == tree(ckpt)
    assert sorted(p.name for p in root.iterdir()) == ["checkpoints", "model"]  # no temp dir left
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["rollout_000009"]


def test_copies_that_would_not_fit_are_refused_naming_the_filesystem(tmp_path):
    small = tmp_path / "small"
    with small_tmpfs(small, "1m") as mounted:
        if not mounted:
            pytest.skip("needs root to mount a small tmpfs")
        model = make_source(tmp_path / "base_model", {"model.safetensors": os.urandom(2 << 20)})
        root = small / "rlhpc-3"
        with pytest.raises(RlhpcError) as e:
            staging.stage(staging.plan(root, str(model), None), root)
        assert str(root) in e.value.problem and "GiB free" in e.value.problem and "stage_dir" in e.value.fix
        assert list(small.iterdir()) == []  # nothing written


def test_a_stage_dir_that_cannot_be_made_is_refused(tmp_path, sources):
    model, _ = sources
    blocker = tmp_path / "file"
    blocker.write_text("")
    root = blocker / "rlhpc-1"  # under a file: not a directory
    with pytest.raises(RlhpcError, match="cannot create the stage dir"):
        staging.stage(staging.plan(root, str(model), None), root)


def test_receive_unpacks_what_task_0_broadcast_and_reports_its_failure(tmp_path, sources):
    model, ckpt = sources
    root = tmp_path / "node1" / "rlhpc-8"
    root.parent.mkdir()
    paths = staging.plan(root, str(model), str(ckpt))
    done = staging.Broadcast("8", tmp_path / "ray" / "staged")
    done.done.parent.mkdir()
    done.done.write_text("failed: sbcast: error: Can't find an address\n")
    with pytest.raises(RlhpcError, match="Can't find an address"):
        staging.receive(paths, root, done, timeout_s=5)
    # what sbcast leaves on a node: the archive task 0 packed (here packed by hand the same way)
    import tarfile

    with tarfile.open(staging._archive(root), "w") as tar:
        for k, src in enumerate(paths):
            tar.add(src, arcname=str(k))
    done.done.write_text("ok\n")
    staged = staging.receive(paths, root, done, timeout_s=5)
    assert tree(Path(staged.get(model))) == tree(model) and tree(Path(staged.get(ckpt))) == tree(ckpt)
    staged.remove()
    assert list(root.parent.iterdir()) == []


def test_sbcast_only_for_a_homogeneous_slurm_job_of_several_nodes(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/sbcast")
    assert staging.use_sbcast(ClusterConfig(stage_dir="/tmp"), "slurm", 2)
    assert not staging.use_sbcast(ClusterConfig(stage_dir="/tmp"), "slurm", 1)
    assert not staging.use_sbcast(ClusterConfig(stage_dir="/tmp"), "local", 2)
    assert not staging.use_sbcast(ClusterConfig(stage_dir="/tmp", stage_with="copy"), "slurm", 2)
    het = ClusterConfig(num_nodes=1, gpus_per_node=2, rollout_nodes=1, stage_dir="/tmp")
    assert not staging.use_sbcast(het, "slurm", 2)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert not staging.use_sbcast(ClusterConfig(stage_dir="/tmp"), "slurm", 2)


@pytest.mark.parametrize("value", ["/local/scratch", "$TMPDIR", "~/stage"])
def test_stage_dir_accepts_absolute_and_node_expanded_paths(value):
    ClusterConfig(stage_dir=value).check()


def test_a_relative_stage_dir_is_refused():
    with pytest.raises(ConfigError, match="not an absolute path"):
        ClusterConfig(stage_dir="scratch").check()


def test_what_ended_jobs_left_is_removed_and_a_live_jobs_copy_kept(tmp_path):
    local = tmp_path / "local"
    for name in ("rlhpc-10", "rlhpc-11", "rlhpc-12"):
        make_source(local / name / "model", {"x": b"1"})
    (local / ".rlhpc-10.tar").write_bytes(b"archive")
    (local / "someone-elses").mkdir()
    states = {"10": False, "11": True, "12": None}  # ended, running, cannot be told
    staging.remove_stale(local / "rlhpc-12", states.get)
    assert sorted(p.name for p in local.iterdir()) == ["rlhpc-11", "rlhpc-12", "someone-elses"]


def test_links_and_names_another_user_planted_in_a_shared_stage_dir_are_neither_followed_nor_fatal(tmp_path):
    # Issue 43, item 5: a dangling link "rlhpc-1" planted by another user made every staged job's
    # sweep fail (it followed links and trusted the target's owner).
    mine = make_source(tmp_path / "mine", {"keep": b"1"})  # a dir and a file of ours elsewhere
    with shared_tmp_dir() as shared:
        out = run_as_other_user(
            "import os, sys; d, mine = sys.argv[1], sys.argv[2]\n"
            "os.symlink('/nonexistent', os.path.join(d, 'rlhpc-1'))\n"
            "os.symlink(mine, os.path.join(d, 'rlhpc-2'))\n"
            "os.symlink(os.path.join(mine, 'keep'), os.path.join(d, '.rlhpc-3.tar'))\n"
            "os.mkdir(os.path.join(d, 'rlhpc-4'))\n",
            str(shared),
            str(mine),
        )
        assert out.returncode == 0, out.stderr
        make_source(shared / "rlhpc-5" / "model", {"x": b"1"})  # ours, of an ended job
        (shared / ".rlhpc-5.tar").write_bytes(b"archive")
        staging.remove_stale(shared / "rlhpc-100", lambda job: False)  # every job ended
        assert sorted(p.name for p in shared.iterdir()) == [".rlhpc-3.tar", "rlhpc-1", "rlhpc-2", "rlhpc-4"]
        staging.Staged(shared / "rlhpc-3").remove()  # its archive's name is the other user's link
        assert (shared / ".rlhpc-3.tar").is_symlink()
    assert tree(mine) == {"keep": b"1"}


def test_a_copy_another_user_planted_for_the_next_job_is_refused(tmp_path, sources):
    # Issue 32, item 2: sizes and mtimes are readable by anyone, so another user can plant a
    # "current" copy (other weights, the same manifest) where the next job id will stage.
    model, _ = sources
    with shared_tmp_dir() as stage_dir:
        planted_for_the_next_job(stage_dir, model)


def planted_for_the_next_job(stage_dir: Path, model: Path) -> None:
    root = staging.stage_root(str(stage_dir), "1001")
    forged = json.dumps(staging.manifest(model))
    out = run_as_other_user(
        "import os, sys; d = os.path.join(sys.argv[1], 'model'); os.makedirs(d); os.chmod(sys.argv[1], 0o777);"
        "open(os.path.join(d, 'model.safetensors'), 'wb').write(b'planted');"
        "open(os.path.join(d, sys.argv[3]), 'w').write(sys.argv[2])",
        str(root),
        forged,
        staging.MANIFEST,
    )
    assert out.returncode == 0, out.stderr
    with pytest.raises(RlhpcError, match="another user") as e:
        staging.stage(staging.plan(root, str(model), None), root)
    assert "cluster.stage_dir" in str(e.value) or "rm -rf" in e.value.fix


def test_a_stage_root_of_ours_is_private(tmp_path, sources):
    model, _ = sources
    root = staging.stage_root(str(tmp_path / "local"), "78")
    staging.stage(staging.plan(root, str(model), None), root)
    assert oct(root.stat().st_mode & 0o777) == "0o700"
