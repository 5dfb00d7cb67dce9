"""Requeue and hold outcomes said plainly (Slurm answers faked), and the local restart cap."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from rlhpc.launch import slurm
from rlhpc.launch.backend import backend
from rlhpc.launch.follow import _slurm_done
from rlhpc.launch.local_controller import LocalExecutor
from rlhpc.launch.requeue import LOCAL_REQUEUE_EXIT_CODE, JobExit


def fake_scontrol(monkeypatch, returncode: int, stderr: str = "") -> list[list[str]]:
    calls = []

    def run(cmd, timeout):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr(slurm, "_run", run)
    return calls


def test_a_refused_requeue_is_not_called_requeued(monkeypatch, caplog):
    fake_scontrol(monkeypatch, 1, "scontrol: error: Requested operation is presently disabled")
    monkeypatch.setattr(slurm, "job_state", lambda job_id: "RUNNING")
    with pytest.raises(JobExit) as e:
        backend("slurm").requeue("42")
    assert e.value.code != 0 and e.value.final  # the job ends FAILED, not COMPLETED
    assert "job 42 was NOT requeued" in caplog.text and "presently disabled" in caplog.text
    assert "job 42 requeued" not in caplog.text


def test_a_requeue_slurm_already_does_is_fine(monkeypatch):
    fake_scontrol(monkeypatch, 1, "scontrol: error: Job is pending execution")
    monkeypatch.setattr(slurm, "job_state", lambda job_id: "REQUEUED")
    with pytest.raises(JobExit) as e:
        backend("slurm").requeue("42")
    assert e.value.code == 0 and not e.value.final


def test_a_failed_requeuehold_ends_the_job_failed(monkeypatch, caplog):
    calls = fake_scontrol(monkeypatch, 1, "scontrol: error: Access/permission denied")
    with pytest.raises(JobExit) as e:
        backend("slurm").hold("42", "a restart loop")
    assert calls == [["scontrol", "requeuehold", "42"]]
    assert e.value.code == 1 and e.value.final and "permission denied" in caplog.text


def test_an_accepted_hold_keeps_the_job(monkeypatch):
    fake_scontrol(monkeypatch, 0)
    with pytest.raises(JobExit) as e:
        backend("slurm").hold("42", "a restart loop")
    assert e.value.code == 0 and not e.value.final


@pytest.mark.parametrize(
    "info,held",
    [
        ({"JobState": "REQUEUE_HOLD", "Reason": "None"}, True),
        ({"JobState": "PENDING", "Reason": "JobHeldAdmin"}, True),
        ({"JobState": "PENDING", "Reason": "JobHeldUser"}, True),
        ({"JobState": "PENDING", "Reason": "Resources"}, False),
        ({"JobState": "RUNNING", "Reason": "None"}, False),
    ],
)
def test_following_ends_at_a_held_job(monkeypatch, tmp_path, info, held):
    monkeypatch.setattr(slurm, "show_job", lambda job_id: info)
    job = SimpleNamespace(job_id="42", paths=SimpleNamespace(result_pickle=tmp_path / "none.pkl"))
    assert _slurm_done(job) is held
    assert (slurm.hold_reason(info) is not None) is held


def test_local_restarts_are_not_capped_at_submitits_six(tmp_path):
    # A task that always asks for a restart (exit 144): started max_starts times, not 6.
    executor = LocalExecutor(tmp_path / "submitit", max_starts=9)
    executor.update_parameters(timeout_min=5, tasks_per_node=1, nodes=1)
    job = executor.submit(sys.exit, LOCAL_REQUEUE_EXIT_CODE)
    job._process.wait(timeout=120)
    assert job.paths.stdout.read_text().count("Starting with JobEnvironment") == 9


def test_a_local_task_killed_by_a_signal_is_said_in_the_controllers_log(tmp_path, capfd):
    # A task that dies by a signal (after its own log's last line) is not restarted, and the
    # controller says so: its own output goes to the submission's stderr.
    executor = LocalExecutor(tmp_path / "submitit", max_starts=3)
    executor.update_parameters(timeout_min=5, tasks_per_node=1, nodes=1)
    job = executor.submit(os.abort)  # SIGABRT
    job._process.wait(timeout=120)
    assert job.paths.stdout.read_text().count("Starting with JobEnvironment") == 1
    assert "rlhpc: local task 0 ended by signal 6" in capfd.readouterr().err


def test_local_executor_allows_the_configured_restarts(tmp_path):
    from rlhpc.launch.local_controller import local_executor
    from rlhpc.run_dir import RunDir

    # the first start, 10 restarts, and the start rlhpc's own policy refuses
    assert local_executor(RunDir(tmp_path), 60, 0, max_restarts=10).max_starts == 12


def test_a_restart_loop_is_counted_within_one_job():
    from rlhpc.runtime.restarts import RestartPolicy, refuse_reason

    policy = RestartPolicy(max_restarts=20, max_starts_without_progress=2)
    start = lambda job, count: {"job_id": job, "restart_count": count, "next_rollout_id": 0}  # noqa: E731
    # one job restarting at the same rollout: the third start is a loop
    assert refuse_reason([start("7", 0), start("7", 1)], policy) is None
    reason = refuse_reason([start("7", 0), start("7", 1), start("7", 2)], policy)
    assert reason is not None and "the last 3 starts all began at rollout 0" in reason
    # three submissions stopped by their user before a rollout: each a decision, not a loop
    assert refuse_reason([start("7", 0), start("8", 0), start("9", 0)], policy) is None
    assert refuse_reason([start("7", 0), start("8", 0), start("8", 1)], policy) is None


def test_a_local_requeue_asks_the_controller_and_a_local_hold_ends_the_job():
    with pytest.raises(JobExit) as e:
        backend("local").requeue("4242")
    assert e.value.code == LOCAL_REQUEUE_EXIT_CODE and not e.value.final
    with pytest.raises(JobExit) as e:
        backend("local").hold("4242", "a restart loop")
    assert e.value.code == 1 and e.value.final


def test_the_local_executor_keeps_submitits_setup_and_visible_gpus(tmp_path):
    # submitit's own start_controller honours both; rlhpc's controller must as well.
    executor = LocalExecutor(tmp_path / "submitit", max_starts=2)
    executor.update_parameters(
        timeout_min=5,
        tasks_per_node=1,
        nodes=1,
        gpus_per_node=1,
        visible_gpus=(3, 5),
        setup=["export RLHPC_SETUP_RAN=1"],
    )
    job = executor.submit(
        subprocess.check_output, ["sh", "-c", "echo $RLHPC_SETUP_RAN $CUDA_VISIBLE_DEVICES"], text=True
    )
    assert job.result().split() == ["1", "3"]
