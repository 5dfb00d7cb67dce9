"""The two backends answer what differs between a local and a Slurm job (no cluster needed)."""

import pytest

from rlhpc.errors import RlhpcError
from rlhpc.launch.backend import LocalBackend, SlurmBackend, backend
from rlhpc.run_dir import RunDir


def test_each_kind_has_its_backend_and_no_other_kind_is_taken():
    assert isinstance(backend("local"), LocalBackend) and isinstance(backend("slurm"), SlurmBackend)
    with pytest.raises(RlhpcError, match="no backend 'debug'"):
        backend("debug")


def test_a_slurm_start_has_a_ray_state_per_attempt_and_a_local_one_a_single_one(tmp_path, monkeypatch):
    run = RunDir(tmp_path)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert backend("slurm").ray_state(run, "77_3").root.name == "job_77_3.2"
    assert backend("local").ray_state(run, "4242").root.name == "job_4242.0"  # whatever Slurm's variables say
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert backend("slurm").ray_state(run, "77").root.name == "job_77.0"


def test_the_run_dir_owner_is_named_after_the_kind():
    import os

    assert backend("slurm").owner("77").kind == "slurm"
    assert backend("local").owner(str(os.getpid())).kind == "local"


def test_a_local_job_is_alive_while_its_controller_is():
    import os

    assert backend("local").job_alive(str(os.getpid())) is True
    assert backend("local").job_alive("not-a-pid") is None
