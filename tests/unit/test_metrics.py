"""metrics.jsonl survives a job killed mid-write: a torn last line is dropped with a warning.
Rollout dumps are written beside the loop, whole or not at all."""

import json
import logging

import h5py
import pytest
import torch
from support.disks import small_tmpfs

from rlhpc.batch import RolloutBatch
from rlhpc.cli import status
from rlhpc.config import LoggingConfig
from rlhpc.errors import RlhpcError
from rlhpc.metrics import MetricsLogger, RolloutDumpError, read_metrics
from rlhpc.run_dir import RunDir

RECORDS = [{"kind": "rollout", "rollout_id": i, "reward": 0.5 + i} for i in range(3)]


def write_lines(run, tail=""):
    run.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + tail)


def open_logger(run):
    return MetricsLogger(run, LoggingConfig(wandb_mode="disabled", dump_rollouts=False), {}, 10, None)


@pytest.fixture
def run(tmp_path):
    return RunDir(tmp_path)


def test_torn_last_line_is_skipped_by_readers(run, caplog):
    write_lines(run, '{"kind": "rollout", "rollout_id": 3, "rew')  # killed mid-write
    with caplog.at_level(logging.WARNING):
        assert read_metrics(run) == RECORDS
    assert "metrics.jsonl line 4 is torn" in caplog.text and "skipping it" in caplog.text
    assert run.metrics_file.read_text().endswith('"rew')  # readers do not write


def test_status_shows_a_run_with_a_torn_last_line(run, capsys):
    write_lines(run, '{"kind": "roll')
    assert status.main([str(run.path)]) == 0
    assert '"rollout_id": 2' in capsys.readouterr().out


def test_logger_drops_a_torn_last_line_before_appending(run, caplog):
    write_lines(run, '{"kind": "rollout", "rollout_id": 3, "rew')
    with caplog.at_level(logging.WARNING):
        metrics = open_logger(run)
    assert "line 4 is torn" in caplog.text and "dropping it" in caplog.text
    assert run.metrics_file.read_text() == "".join(json.dumps(r) + "\n" for r in RECORDS)
    metrics.rewind(3)
    metrics.log("rollout", 3, {"reward": 3.5})
    assert [r["rollout_id"] for r in read_metrics(run)] == [0, 1, 2, 3]


def test_complete_last_line_without_newline_is_kept(run):
    write_lines(run)
    run.metrics_file.write_text(run.metrics_file.read_text().rstrip("\n"))  # killed before the newline
    metrics = open_logger(run)
    metrics.log("rollout", 3, {"reward": 3.5})
    assert [r["rollout_id"] for r in read_metrics(run)] == [0, 1, 2, 3]


@pytest.mark.parametrize("reader", [read_metrics, open_logger])
def test_torn_line_in_the_middle_is_an_error(run, reader):
    lines = [json.dumps(r) for r in RECORDS]
    lines[1] = lines[1][:10]
    run.metrics_file.write_text("\n".join(lines) + "\n")
    with pytest.raises(RlhpcError, match=r"metrics\.jsonl.*line 2") as e:
        reader(run)
    assert "corrupt" in str(e.value)


# ------------------------------------------------------------ rollout dumps, written beside the loop


def rollout_batch(num: int, response_len: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(num)
    ids = [torch.randint(3, 20, (response_len,), generator=g).tolist() for _ in range(num)]
    return RolloutBatch(
        [[1, 5, 6]] * num, ids, [[-0.5] * response_len] * num, torch.rand(num), torch.rand(num), 4,
        [0] * num, [[0] * response_len] * num,
    )  # fmt: skip


def dump_logger(run):
    return MetricsLogger(run, LoggingConfig(wandb_mode="disabled", dump_rollouts=True), {}, 10, None)


def test_rollout_dumps_are_whole_once_waited_for(run):
    metrics = dump_logger(run)
    batches = [rollout_batch(8, 5 + i) for i in range(3)]
    for i, b in enumerate(batches):
        metrics.dump_rollout(i, b, {"response": [str(i)] * len(b)})  # waits for the one before
    metrics.wait_dumps()
    for i, b in enumerate(batches):
        with h5py.File(run.rollout_dump(i)) as f:
            assert [list(r) for r in f["response_ids"][:]] == b.response_ids
            assert f["response"][0].decode() == str(i) and f.attrs["rollout_id"] == i
    metrics.close()
    assert sorted(p.name for p in run.rollouts_dir.iterdir()) == [f"rollout_00000{i}.h5" for i in range(3)]


def test_a_dump_keeps_texts_that_hdf5_strings_cannot_hold(run):
    """A byte-level token can decode to NUL, and HDF5 strings end at NUL (h5py refused the whole
    dump): the text is stored readable (NUL as U+2400), the ids exactly."""
    metrics = dump_logger(run)
    batch = rollout_batch(2, 3)
    metrics.dump_rollout(0, batch, {"response": ["a\x00b", "caf\u00e9 \ud800"]})
    metrics.wait_dumps()
    with h5py.File(run.rollout_dump(0)) as f:
        assert [r.decode() for r in f["response"][:]] == ["a\u2400b", "caf\u00e9 \ufffd"]
        assert [list(r) for r in f["response_ids"][:]] == batch.response_ids
    metrics.close()


def test_a_dump_on_a_full_disk_stops_the_run_at_the_next_rollout_and_leaves_nothing(tmp_path, caplog):
    disk = tmp_path / "small"
    with small_tmpfs(disk, "1m") as mounted:
        if not mounted:
            pytest.skip("needs root to mount a small tmpfs")
        run = RunDir(disk / "run")
        run.path.mkdir()
        metrics = dump_logger(run)
        metrics.dump_rollout(0, rollout_batch(8, 4), {})
        metrics.dump_rollout(1, rollout_batch(256, 2048), {})  # ~4 MB of tokens: does not fit
        with pytest.raises(RolloutDumpError) as e:
            metrics.dump_rollout(2, rollout_batch(8, 4), {})  # the next rollout learns of it
        assert "rollout 1" in e.value.problem and "No space left" in e.value.problem
        assert f"mounted at {disk}" in e.value.problem and "bytes free" in e.value.problem
        assert "free space on that filesystem" in e.value.fix and "logging.dump_rollouts=false" in e.value.fix
        assert sorted(p.name for p in run.rollouts_dir.iterdir()) == ["rollout_000000.h5"]  # no temp file
        with h5py.File(run.rollout_dump(0)) as f:
            assert len(f["response_ids"]) == 8  # the one before is intact
        # a failed dump in flight when the loop ends on its own error: a warning, not a second error
        metrics.dump_rollout(3, rollout_batch(256, 2048), {})
        with caplog.at_level(logging.WARNING):
            metrics.close()
        assert "writing the last rollout dump failed" in caplog.text and "rollout 3" in caplog.text
        assert sorted(p.name for p in run.rollouts_dir.iterdir()) == ["rollout_000000.h5"]
