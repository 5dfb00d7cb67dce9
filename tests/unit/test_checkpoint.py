"""Checkpoint directory scheme: staging, manifest, atomic latest, retention, fallback."""

import json
import logging

from rlhpc.checkpoint import LATEST, CheckpointManager, validate


def save(mgr, rollout_id, payload=b"weights"):
    staging = mgr.stage(rollout_id)
    (staging / "actor").mkdir()
    (staging / "actor" / "model.bin").write_bytes(payload)
    return mgr.commit(staging, rollout_id, {"data": {"epoch": 0}})


def test_commit_then_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    assert mgr.latest() is None
    ck = save(mgr, 4)
    assert ck.path.name == "rollout_000004" and ck.next_rollout_id == 5
    assert (tmp_path / LATEST).read_text().strip() == "rollout_000004"
    got = mgr.latest()
    assert got.rollout_id == 4 and got.state["data"] == {"epoch": 0}
    assert json.loads((ck.path / "COMPLETE").read_text())["files"]["actor/model.bin"] == 7


def test_keep_last(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for i in range(5):
        save(mgr, i)
    assert sorted(p.name for p in tmp_path.glob("rollout_*")) == ["rollout_000003", "rollout_000004"]


def test_interrupted_save_is_never_read(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save(mgr, 1)
    staging = mgr.stage(2)  # killed mid-write: staging dir with partial files, no marker
    (staging / "half").write_bytes(b"xx")
    assert mgr.latest().rollout_id == 1
    save(mgr, 2)  # the next attempt replaces the leftovers
    assert mgr.latest().rollout_id == 2 and not any(tmp_path.glob(".staging-*"))


def test_damaged_newest_falls_back_with_warning(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save(mgr, 1)
    ck = save(mgr, 2)
    (ck.path / "actor" / "model.bin").write_bytes(b"short")  # truncated file
    assert "manifest says 7" in validate(ck.path)
    with caplog.at_level(logging.WARNING):
        assert mgr.latest().rollout_id == 1
    assert "falling back" in caplog.text


def test_resave_same_rollout_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    save(mgr, 3, b"old")
    ck = save(mgr, 3, b"newer")
    assert (ck.path / "actor" / "model.bin").read_bytes() == b"newer"
    assert validate(ck.path) is None


def test_newer_complete_dir_wins_over_stale_pointer(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save(mgr, 1)
    save(mgr, 2)
    (tmp_path / LATEST).write_text("rollout_000001\n")  # crash between rename and pointer update
    assert mgr.latest().rollout_id == 2
