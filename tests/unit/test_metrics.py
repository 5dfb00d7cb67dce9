"""metrics.jsonl survives a job killed mid-write: a torn last line is dropped with a warning."""

import json
import logging

import pytest

from rlhpc.cli import status
from rlhpc.config import LoggingConfig
from rlhpc.errors import RlhpcError
from rlhpc.metrics import MetricsLogger, read_metrics
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
