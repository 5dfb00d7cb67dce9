"""One live job per run dir: owner file claimed, refused while its job lives, stale ones taken over."""

import json
import socket
import subprocess
import sys

import pytest
from support.other_user import run_as_other_user_in_background

from rlhpc.errors import RunDirError
from rlhpc.launch import run_owner, slurm
from rlhpc.launch.run_owner import Owner
from rlhpc.run_dir import RunDir


def claim_and_check(run: RunDir, me: Owner) -> None:
    """claim(), then the owner file names ``me``: a claim that returned without writing fails here."""
    run_owner.claim(run, me)
    assert run_owner.read(run).same_as(me)
    assert not [p.name for p in run.path.iterdir() if p.name != "owner.json"]  # nothing left aside


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def test_claim_refuse_while_alive_take_over_when_gone(tmp_path, sleeper, caplog):
    run = RunDir(tmp_path / "run")
    first = Owner.local_job(sleeper.pid)
    claim_and_check(run, first)
    assert json.loads(run.owner_file.read_text())["pid"] == sleeper.pid
    claim_and_check(run, first)  # the owner itself (a restart) is welcome
    with pytest.raises(RunDirError) as e:
        run_owner.claim(run, Owner.submitter())
    assert f"local job {sleeper.pid}" in e.value.problem and socket.gethostname() in e.value.problem
    assert "wait" in e.value.fix and "--run-dir" in e.value.fix
    with pytest.raises(RunDirError):
        run_owner.check_free(run)
    sleeper.kill()
    sleeper.wait()
    me = Owner.submitter()
    run_owner.check_free(run)
    claim_and_check(run, me)
    assert "which is gone" in caplog.text and "taking it over" in caplog.text
    assert Owner.from_json(run.owner_file.read_text()).same_as(me)
    assert sorted(p.name for p in run.path.iterdir()) == ["owner.json"]  # nothing left aside


def test_a_reused_pid_is_not_the_owner(tmp_path):
    run = RunDir(tmp_path / "run")
    me = Owner.submitter()
    run.path.mkdir()
    run.owner_file.write_text(Owner("local", "1", me.host, me.pid, me.started - 1000).to_json())
    claim_and_check(run, me)  # same pid, another start time: stale


def test_an_owner_on_another_host_is_named(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.owner_file.write_text(Owner("local", "77", "elsewhere", 77, 1.0).to_json())
    with pytest.raises(RunDirError) as e:
        run_owner.claim(run, Owner.submitter())
    assert "host elsewhere" in e.value.problem and "cannot be checked from here" in e.value.problem


@pytest.mark.parametrize("state", ["PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "SUSPENDED", "COMPLETING"])
def test_a_live_slurm_job_owns_the_run_dir(tmp_path, monkeypatch, state):
    run = RunDir(tmp_path / "run")
    claim_and_check(run, Owner.slurm_job("4242"))
    monkeypatch.setattr(slurm, "job_state", lambda job_id: state)
    with pytest.raises(RunDirError) as e:
        run_owner.claim(run, Owner.submitter())
    assert "Slurm job 4242" in e.value.problem and state in e.value.problem and "scancel 4242" in e.value.fix
    claim_and_check(run, Owner.slurm_job("4242"))  # the job itself, starting (or restarting)


@pytest.mark.parametrize("state", ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", None])
def test_an_ended_slurm_job_is_taken_over(tmp_path, monkeypatch, state):
    run = RunDir(tmp_path / "run")
    claim_and_check(run, Owner.slurm_job("4242"))
    monkeypatch.setattr(slurm, "job_state", lambda job_id: state)
    claim_and_check(run, Owner.slurm_job("4243"))
    assert run_owner.read(run) == Owner.slurm_job("4243")


def test_a_slurm_job_whose_state_cannot_be_asked_is_not_taken_over(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    claim_and_check(run, Owner.slurm_job("4242"))

    def unreachable(job_id):
        raise slurm.SlurmUnreachable(f"state of job {job_id} unknown: connect failure")

    monkeypatch.setattr(slurm, "job_state", unreachable)
    with pytest.raises(RunDirError) as e:
        run_owner.claim(run, Owner.slurm_job("4243"))
    assert "cannot be asked" in e.value.problem and "4242" in e.value.problem
    assert run_owner.read(run) == Owner.slurm_job("4242")


def test_release_only_by_the_owner(tmp_path):
    run = RunDir(tmp_path / "run")
    claim_and_check(run, Owner.slurm_job("1"))
    run_owner.release(run, Owner.slurm_job("2"))
    assert run.owner_file.exists()
    run_owner.release(run, Owner.slurm_job("1"))
    assert not run.owner_file.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="psutil's Linux boot time is what moves")
def test_an_owner_is_still_itself_after_the_wall_clock_moved(tmp_path, sleeper, monkeypatch):
    """A restarting local job must know its own claim after the clock was adjusted: psutil reads
    the boot time from the wall clock, which moved a whole second on this machine within minutes;
    the start since boot does not move."""
    import psutil._pslinux

    run = RunDir(tmp_path / "run")
    first = Owner.local_job(sleeper.pid)
    claim_and_check(run, first)
    later = psutil._pslinux.boot_time() + 1.0
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: later)
    again = Owner.local_job(sleeper.pid)
    assert again.same_as(first)
    claim_and_check(run, again)  # the owner itself: welcome, not refused as another job
    assert run_owner.liveness(first).alive is True


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '"local"',
        '{"kind": "local", "pid": "abc", "host": "h", "started": 1}',
        '{"kind": "local", "pid": null, "host": "h", "started": 1}',
        '{"kind": "slurm", "job_id": 5}',
        '{"kind": "root"}',
    ],
)
def test_an_owner_file_we_did_not_write_is_stale_not_a_traceback(tmp_path, text):
    # Issue 32, item 9. (pid null once read as psutil.Process(None): this very process, alive.)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.owner_file.write_text(text)
    assert run_owner.read(run).kind == "unreadable"
    run_owner.check_free(run)
    claim_and_check(run, Owner.submitter())


def test_a_forged_owner_naming_init_does_not_lock_the_run_dir(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    init = Owner.process(1, "local", job_id="1")  # its true start time: only the pid is forged
    run.owner_file.write_text(init.to_json())
    claim_and_check(run, Owner.submitter())


def test_another_users_process_is_not_the_owner(tmp_path):
    other = run_as_other_user_in_background("import time; time.sleep(60)")
    try:
        run = RunDir(tmp_path / "run")
        run.path.mkdir()
        run.owner_file.write_text(Owner.local_job(other.pid).to_json())
        assert run_owner.liveness(run_owner.read(run)).alive is False
        claim_and_check(run, Owner.submitter())
    finally:
        other.kill()
        other.wait()
