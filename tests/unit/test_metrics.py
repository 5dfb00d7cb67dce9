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


def full_batch() -> RolloutBatch:
    """Two samples with every optional field known."""
    return RolloutBatch(
        [[1, 2], [3]], [[4], [5, 6]], [[-0.5], [-0.6, -0.7]], torch.tensor([1.0, 0.0]), torch.tensor([0.5, -0.5]), 2,
        weight_versions=[1, 2], token_versions=[[1], [2, 2]], loss_masks=[[1], [1, 0]], turns=[[0], [0, 1]],
        truncated=[False, True], teacher_logprobs=[[-0.1], [-0.2, -0.3]],
    )  # fmt: skip


def test_a_dump_holds_every_field_of_the_batch_under_its_name(run):
    """The dump is derived from RolloutBatch's fields: one added there is dumped without a second list."""
    metrics = dump_logger(run)
    batch = full_batch()
    metrics.dump_rollout(0, batch, {})
    metrics.wait_dumps()
    with h5py.File(run.rollout_dump(0)) as f:
        assert sorted(f) == sorted(
            ["prompt_ids", "response_ids", "rollout_logprobs", "rewards", "advantages", "weight_versions"]
            + ["token_versions", "loss_mask", "turn", "truncated", "teacher_logprobs"]
        )
        assert f.attrs["group_size"] == 2 and f["loss_mask"].dtype.metadata["vlen"] == "int8"
        assert [list(r) for r in f["turn"][:]] == batch.turns and list(f["truncated"][:]) == batch.truncated
        assert [r.tolist() for r in f["teacher_logprobs"][:]] == [pytest.approx(r) for r in batch.teacher_logprobs]
    metrics.dump_rollout(1, rollout_batch(2, 3), {})  # optional fields unknown: left out
    metrics.wait_dumps()
    with h5py.File(run.rollout_dump(1)) as f:
        assert "loss_mask" not in f and "teacher_logprobs" not in f and "weight_versions" in f
    metrics.close()


def test_a_batch_round_trips_through_its_state_dict_and_an_older_one_lacks_optional_fields():
    batch = full_batch()
    back = RolloutBatch.from_state_dict(batch.state_dict())
    assert all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(back.values(), batch.values())
    )
    older = {k: v for k, v in batch.state_dict().items() if k not in ("teacher_logprobs", "turns")}
    assert RolloutBatch.from_state_dict(older).teacher_logprobs == []
    half = batch.slice(1, 2)
    assert half.turns == [[0, 1]] and half.group_size == 2 and half.rewards.tolist() == [0.0]
