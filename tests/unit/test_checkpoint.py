"""Checkpoint directory scheme: staging, manifest, atomic latest, retention, fallback."""

import json
import logging
import multiprocessing
import os
import resource
import signal
import threading
import time

import pytest
from support.disks import small_tmpfs

from rlhpc.checkpoint import LATEST, CheckpointManager, validate
from rlhpc.errors import RlhpcError


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


# ------------------------------------------------------------ retention (issue 12, item 4)


def rollout_dirs(root):
    return sorted(p.name for p in root.glob("rollout_*"))


def test_saving_an_older_rollout_never_removes_it(tmp_path, caplog):
    # rollouts 19 and 29 left by an earlier run (resume: never, --force); the new run saves 9
    mgr = CheckpointManager(tmp_path, keep_last=2)
    save(mgr, 19)
    save(mgr, 29)
    with caplog.at_level(logging.WARNING):
        ck = save(mgr, 9)
    assert ck.path.is_dir() and validate(ck.path) is None
    assert (tmp_path / LATEST).read_text().strip() == "rollout_000009"
    assert mgr.latest().rollout_id == 9  # the stale newer ones are out of the way ...
    assert rollout_dirs(tmp_path) == ["rollout_000009"]
    aside = [p.relative_to(tmp_path).parts for p in tmp_path.glob("superseded-*/rollout_*")]
    assert sorted(name for _, name in aside) == ["rollout_000019", "rollout_000029"]  # ... but not deleted
    assert "superseded" in caplog.text


def test_damaged_dirs_do_not_count_toward_keep_last(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    save(mgr, 1)
    save(mgr, 2)
    (tmp_path / "rollout_000003").mkdir()  # damaged: no marker
    save(mgr, 4)
    assert rollout_dirs(tmp_path) == ["rollout_000002", "rollout_000004"]  # two valid ones
    (tmp_path / "rollout_000004" / "COMPLETE").unlink()
    assert mgr.latest().rollout_id == 2


def test_start_fresh_sets_every_checkpoint_aside(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    save(mgr, 5)
    save(mgr, 6)
    aside = mgr.start_fresh()  # resume: never
    assert mgr.latest() is None and rollout_dirs(tmp_path) == [] and not (tmp_path / LATEST).exists()
    assert sorted(p.name for p in aside.iterdir()) == [LATEST, "rollout_000005", "rollout_000006"]
    save(mgr, 0)
    assert mgr.latest().rollout_id == 0
    assert mgr.start_fresh() is not None and CheckpointManager(tmp_path, 2).start_fresh() is None  # nothing left


# ------------------------------------------------------------ a full disk (issue 12, item 5)


def debris(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def write_until_full(staging):
    """An actor writer on a full disk: fails, or swallows the error and leaves the disk full."""
    (staging / "actor").mkdir()
    with open(staging / "actor" / "model.bin", "wb") as f:
        for _ in range(64):
            f.write(b"x" * (256 << 10))
            f.flush()


def fill_then_stop(staging):
    try:
        write_until_full(staging)
    except OSError:
        pass  # the disk is now full: the state file or the manifest is what fails


def full_disk_scenario(root, writer):
    """Save 1, then a save that fills the disk; returns the error message of the failed save."""
    mgr = CheckpointManager(root, keep_last=2)
    save(mgr, 1)
    try:
        mgr.save(2, writer, {"data": {"epoch": 0}})
    except RlhpcError as e:
        message = str(e)
    else:
        raise AssertionError("the save on a full disk did not fail")
    assert debris(root) == [], debris(root)
    assert rollout_dirs(root) == ["rollout_000001"] and mgr.latest().rollout_id == 1
    assert (root / LATEST).read_text().strip() == "rollout_000001"
    return message


def in_child_with_file_size_limit(fn, *args):
    """Run ``fn`` in a forked child whose files cannot grow past 2 MiB (EFBIG, like a full disk)."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()

    def child():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
        try:
            out.put(("ok", fn(*args)))
        except BaseException as e:
            out.put(("error", repr(e)))

    p = ctx.Process(target=child)
    p.start()
    status, value = out.get(timeout=120)
    p.join()
    assert status == "ok", value
    return value


@pytest.mark.parametrize("writer", [write_until_full, fill_then_stop])
def test_a_save_on_a_full_disk_leaves_no_debris(tmp_path, writer):
    disk = tmp_path / "small"
    with small_tmpfs(disk, "2m") as mounted:
        if mounted:  # a real full filesystem
            message = full_disk_scenario(disk / "checkpoints", writer)
            assert "No space left on device" in message
            assert str(disk) in message and "bytes free" in message  # which filesystem is full
            assert "free space on that filesystem" in message
        else:  # not root: a file-size limit makes the writes fail for real
            if writer is fill_then_stop:
                pytest.skip("a file-size limit cannot fill the disk for the next file; needs a tmpfs (root)")
            message = in_child_with_file_size_limit(full_disk_scenario, disk / "checkpoints", writer)
    assert "rollout 2" in message and "rollout_000001" in message and "fix:" in message


def test_clean_debris_at_start(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    save(mgr, 1)
    (tmp_path / ".staging-rollout_000002").mkdir()  # a save killed (SIGKILL, node lost)
    (tmp_path / ".staging-rollout_000002" / "model.bin").write_bytes(b"x" * 100)
    (tmp_path / ".staging-old-rollout_000001").mkdir()  # the old copy of a re-save that completed
    (tmp_path / ".latest.tmp-4242").write_text("rollout_000002\n")
    CheckpointManager(tmp_path, keep_last=2).clean_debris()
    assert debris(tmp_path) == [] and mgr.latest().rollout_id == 1


def test_clean_debris_restores_a_checkpoint_caught_between_the_renames_of_a_resave(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    save(mgr, 1)
    ck = save(mgr, 2)
    ck.path.rename(tmp_path / ".staging-old-rollout_000002")  # killed right after moving the old copy away
    mgr.clean_debris()
    assert debris(tmp_path) == [] and mgr.latest().rollout_id == 2


# ------------------------------------------------------------ the manifest (issue 12, item 12)


@pytest.mark.parametrize(
    "manifest",
    [
        {"rollout_id": 2},
        [],
        {"files": ["actor/model.bin"]},
        {"files": {"actor/model.bin": "7"}},
        {"files": {"../x": 1}},
    ],
)
def test_malformed_manifest_falls_back(tmp_path, caplog, manifest):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save(mgr, 1)
    ck = save(mgr, 2)
    (ck.path / "COMPLETE").write_text(json.dumps(manifest))
    assert "manifest" in validate(ck.path)
    with caplog.at_level(logging.WARNING):
        assert mgr.latest().rollout_id == 1
    assert "falling back" in caplog.text


def test_flipped_byte_is_caught(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save(mgr, 1)
    ck = save(mgr, 2)
    model = ck.path / "actor" / "model.bin"
    model.write_bytes(b"weighTs")  # same size, one byte different
    assert "checksum" in validate(ck.path)
    with caplog.at_level(logging.WARNING):
        assert mgr.latest().rollout_id == 1
    assert validate(ck.path, content=False) is None  # the quick check sees sizes only


def test_manifest_of_the_previous_version_still_loads(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    ck = save(mgr, 2)
    old = {"rollout_id": 2, "files": json.loads((ck.path / "COMPLETE").read_text())["files"]}
    (ck.path / "COMPLETE").write_text(json.dumps(old, indent=1))  # sizes only, no checksums
    assert validate(ck.path) is None and mgr.latest().rollout_id == 2
    (ck.path / "actor" / "model.bin").write_bytes(b"short")
    assert "manifest says 7" in validate(ck.path)


# ------------------------------------------------------------ asynchronous saves (issue 11)


def snapshot_of(payload, release=None):
    """A ``save_async`` snapshot step: the staging dir exists; the write waits for ``release``."""

    def snapshot(staging):
        (staging / "actor").mkdir()

        def write():
            if release is not None:
                assert release.wait(60)
            (staging / "actor" / "model.bin").write_bytes(payload)

        return write

    return snapshot


def test_async_save_commits_in_the_background(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    save(mgr, 1)
    release = threading.Event()
    mgr.save_async(2, snapshot_of(b"second", release), {"data": {"epoch": 0}})
    # save_async returned while the write waits: the caller goes on, the previous checkpoint is the newest
    assert mgr.in_flight == 2 and mgr.collect() is None
    assert mgr.latest().rollout_id == 1 and (tmp_path / LATEST).read_text().strip() == "rollout_000001"
    release.set()
    ck = mgr.wait()
    assert ck.rollout_id == 2 and mgr.latest().rollout_id == 2 and mgr.in_flight is None
    assert (ck.path / "actor" / "model.bin").read_bytes() == b"second" and debris(tmp_path) == []
    assert mgr.collect() >= 0 and mgr.collect() is None  # the write time, reported once
    assert mgr.wait() is None  # nothing in flight


def test_at_most_one_async_save_in_flight(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    first = threading.Event()
    mgr.save_async(1, snapshot_of(b"one", first), {})
    second_started = threading.Event()

    def next_save():
        mgr.save_async(2, snapshot_of(b"two"), {})
        second_started.set()

    t = threading.Thread(target=next_save)
    t.start()
    assert not second_started.wait(0.2)  # blocked on the commit of the first (not a timing claim: it cannot pass it)
    assert not (tmp_path / ".staging-rollout_000002").exists()
    first.set()
    t.join(60)
    assert (tmp_path / "rollout_000001").is_dir()  # committed before the second save staged
    assert mgr.wait().rollout_id == 2


def test_a_failed_background_write_raises_at_the_next_wait(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    save(mgr, 1)

    def snapshot(staging):
        (staging / "actor").mkdir()

        def write():
            raise OSError(28, "No space left on device")

        return write

    mgr.save_async(2, snapshot, {})
    with pytest.raises(RlhpcError, match="rollout 2.*No space left") as e:
        mgr.save_async(3, snapshot_of(b"three"), {})  # the next save waits for the failed one first
    assert "rollout_000001 is intact" in str(e.value)
    assert debris(tmp_path) == [] and mgr.latest().rollout_id == 1 and mgr.in_flight is None


# Where the background write + commit of rollout 2 is killed, and which checkpoint resume then uses.
PHASES = {
    "write": 1,  # the ranks' files half-written into staging
    "manifest": 1,  # state written, checksums being computed
    "marker": 1,  # COMPLETE written, not yet renamed
    "latest": 2,  # renamed, ``latest`` still names rollout 1
    "retention": 2,  # ``latest`` replaced, old checkpoints not yet pruned
}


def pause_at_phase(root, phase):
    """A child process: checkpoints 0 and 1, then an async save of 2 that stops for good at ``phase``."""
    from rlhpc import checkpoint

    def pause():
        (root.parent / f"paused-{phase}").write_text("")
        while True:
            time.sleep(1)

    def before(fn, name, when=lambda *args: True):
        def wrapped(*args, **kwargs):
            if name == phase and when(*args):
                pause()
            return fn(*args, **kwargs)

        return wrapped

    mgr = CheckpointManager(root, keep_last=2)
    save(mgr, 0)
    save(mgr, 1)
    checkpoint._manifest = before(checkpoint._manifest, "manifest")
    checkpoint.os.replace = before(os.replace, "marker", lambda src, dst: src.name.startswith(".staging-rollout"))
    checkpoint.write_atomic = before(checkpoint.write_atomic, "latest", lambda path, text: path.name == LATEST)
    mgr._retain = before(mgr._retain, "retention")

    def snapshot(staging):
        (staging / "actor").mkdir()

        def write():
            (staging / "actor" / "model.bin").write_bytes(b"half")
            if phase == "write":
                pause()
            (staging / "actor" / "model.bin").write_bytes(b"complete")

        return write

    mgr.save_async(2, snapshot, {"data": {"epoch": 0}})
    (root.parent / "caller-went-on").write_text("")  # save_async returned: the write runs on its own thread
    mgr.wait()


@pytest.mark.parametrize("phase", PHASES)
def test_sigkill_at_each_phase_of_a_background_save(tmp_path, phase):
    root = tmp_path / "checkpoints"
    child = multiprocessing.get_context("fork").Process(target=pause_at_phase, args=(root, phase))
    child.start()
    try:
        deadline = time.monotonic() + 60
        # Both: the background save stopped at its phase, and the caller of save_async went on meanwhile.
        while not ((tmp_path / f"paused-{phase}").exists() and (tmp_path / "caller-went-on").exists()):
            assert child.is_alive() and time.monotonic() < deadline, f"the save never reached {phase}"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)  # no cleanup of any kind
    finally:
        child.join(10)
    mgr = CheckpointManager(root, keep_last=2)
    mgr.clean_debris()  # what the next job does first
    ck = mgr.latest()
    assert ck.rollout_id == PHASES[phase] and validate(ck.path) is None
    assert debris(root) == [] and not list(root.glob(".staging-*"))
    if ck.rollout_id == 2:
        assert (ck.path / "actor" / "model.bin").read_bytes() == b"complete"
    # the next save after the resume commits as usual
    save(mgr, ck.rollout_id + 1)
    assert mgr.latest().rollout_id == ck.rollout_id + 1
