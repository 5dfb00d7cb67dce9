"""The data order is a pure function of (seed, rollout id), so resume needs only the id."""

import pytest

from rlhpc.data.buffer import DataBuffer
from rlhpc.data.files import read_rows
from rlhpc.data.tasks import TASKS, load_split
from rlhpc.errors import ConfigError

ROWS = [{"prompt": str(i), "answer": str(i)} for i in range(10)]


def test_epochs_cover_every_row_once_in_a_new_order():
    buf = DataBuffer(ROWS, rollout_batch_size=3, seed=1)
    assert buf.num_rollout_per_epoch == 3  # the partial 4th batch is dropped
    epoch0 = [r["prompt"] for i in range(3) for r in buf.batch(i)]
    epoch1 = [r["prompt"] for i in range(3, 6) for r in buf.batch(i)]
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9
    assert epoch0 != epoch1
    assert buf.is_epoch_end(2) and not buf.is_epoch_end(3)


def test_resumed_buffer_gives_the_same_batches():
    a = DataBuffer(ROWS, 3, seed=7)
    b = DataBuffer(ROWS, 3, seed=7)
    b.check_resume(a.state_dict(next_rollout_id=4))
    assert [a.batch(i) for i in range(4, 9)] == [b.batch(i) for i in range(4, 9)]


def test_resume_on_changed_data_is_refused():
    state = DataBuffer(ROWS, 3, seed=7).state_dict(4)
    with pytest.raises(ConfigError, match="data_fingerprint"):
        DataBuffer(ROWS[:-1], 3, seed=7).check_resume(state)
    with pytest.raises(ConfigError, match="seed"):
        DataBuffer(ROWS, 3, seed=8).check_resume(state)


def test_too_little_data():
    with pytest.raises(ConfigError, match="rollout_batch_size"):
        DataBuffer(ROWS, 11, seed=0)


def test_generated_tasks_are_deterministic_and_scored():
    for task in TASKS.values():
        rows = load_split(task, None, 20, seed=3)
        assert rows == load_split(task, None, 20, seed=3)
        if task.name == "code":  # its answers run in the sandbox: tests/integration/test_sandbox.py
            continue
        assert all(task.reward(r["prompt"], r["answer"], r["answer"]) == 1.0 for r in rows)
    assert TASKS["digit_sum"].reward("3+4=", "7", "7") == 1.0
    assert TASKS["digit_sum"].reward("3+4=", "6", "7") == 0.0


def test_jsonl_errors_name_the_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": 5}\n')
    with pytest.raises(ConfigError, match=r"d.jsonl line 2 has no 'answer'"):
        read_rows(f)
    f.write_text('{"prompt": "1+1=", "answer": 2}\n')
    assert read_rows(f) == [{"prompt": "1+1=", "answer": 2}] and read_rows(f)[0].label == "2"
