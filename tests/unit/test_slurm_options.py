"""Submission-side pieces that need no cluster: time formats, passthrough, ports, dry run."""

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.other_user import make_as_other_user

from rlhpc.errors import ConfigError, RlhpcError
from rlhpc.launch.ray_cluster import FIRST_PORT, NUM_BLOCKS, PORT_BLOCK, RayNode, RayPorts, block_index, choose_ports
from rlhpc.launch.slurm import het_group, parse_extra, parse_time

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "text,minutes",
    [
        ("90", 90),
        ("24:00:00", 1440),
        ("1:30:00", 90),
        ("0:30:30", 31),
        ("1-12", 2160),
        ("2-00:30", 2910),
        ("1-0:0:1", 1441),
        ("10:30", 11),
    ],
)
def test_slurm_time_formats(text, minutes):
    assert parse_time(text) == minutes


def test_bad_time():
    with pytest.raises(ConfigError, match="not a Slurm time"):
        parse_time("tomorrow")


def test_sbatch_passthrough():
    assert parse_extra(["mail-type=END", "--hold", "comment=a=b"]) == {
        "mail-type": "END",
        "hold": True,
        "comment": "a=b",
    }


def first_choice(job_id: str) -> RayPorts:
    """The block a job's node takes when all its ports are free: what RayNode._start picks."""
    return choose_ports(block_index(job_id), is_free=lambda p: True)


def test_port_blocks_per_job():
    a, b = first_choice("1234"), first_choice("1235")
    ports_a = set(vars(a).values())
    assert len(ports_a) == len(vars(a)) == 12  # no port used twice inside a job
    # Ray's Prometheus endpoints on the job's ports (issue 43, item 12), its node exporter off
    assert a.env() == {
        "RAY_enable_metrics_collection": "0",
        "DASHBOARD_METRIC_PORT": str(a.dashboard_metrics),
        "AUTOSCALER_METRIC_PORT": str(a.autoscaler_metrics),
    }
    assert {a.dashboard_metrics, a.autoscaler_metrics} <= set(a.all()) - set(range(a.min_worker, a.max_worker + 1))
    assert not (set(range(a.gcs, a.gcs + PORT_BLOCK)) & set(range(b.gcs, b.gcs + PORT_BLOCK)))
    assert not a.min_worker <= a.gcs <= a.max_worker  # ray start refuses a GCS port in the worker range
    assert FIRST_PORT <= a.gcs and a.max_worker < FIRST_PORT + NUM_BLOCKS * PORT_BLOCK <= 32768  # below ephemeral ports


def test_array_task_ids_do_not_alias_plain_ids():
    blocks = {first_choice(j).gcs for j in ("77_3", "773", "77_4", "7_73")}
    assert len(blocks) == 4


def test_taken_ports_move_to_the_next_free_block():
    # Jobs 1234 and 1454 share a first choice (220 blocks); the second finds it taken and moves.
    assert block_index("1234") == block_index("1454")
    first = first_choice("1234")
    taken = set(first.all())
    ports = choose_ports(block_index("1454"), is_free=lambda p: p not in taken)
    assert ports.index == first.index + 1 and not taken & set(ports.all())
    # A real listener on one port of a block (here the raylet's) is seen by the bind test.
    block = RayPorts.block(123)
    with socket.socket() as s:
        s.bind(("0.0.0.0", block.node_manager))
        s.listen()
        assert choose_ports(123).index != 123


def test_no_free_block_is_a_clear_error():
    with pytest.raises(RlhpcError, match="no free block of Ray ports"):
        choose_ports(0, is_free=lambda p: False)


def test_node_temp_dir_is_removed_when_the_task_stops(tmp_path):
    node = RayNode(tmp_path / "ray" / "job_1.0", f"t{os.getpid()}", 3, 0, 1)
    (node.temp_dir / "session").mkdir(parents=True)
    node.stop()
    assert not node.temp_dir.exists()


def test_a_task_dir_another_user_made_first_is_refused_before_ray_starts(tmp_path):
    # /tmp/rlhpc-JOB-RANK is predictable: another user of the node may make it first (issue 32).
    node = RayNode(tmp_path / "ray" / "job_1.0", f"t{os.getpid()}", 4, 0, 1)
    node.state.root.mkdir(parents=True)
    make_as_other_user(str(node.temp_dir))
    try:
        with pytest.raises(RlhpcError, match="another user"):
            node._start(0, lambda ports: [])
        assert node.proc is None
    finally:
        subprocess.run(["rm", "-rf", str(node.temp_dir)], check=True)


def test_the_scripts_paths_are_one_word_whatever_the_run_dir_holds(tmp_path):
    run = tmp_path / "a b;$(touch pwned)'\"x"  # issue 32, item 8
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--run-dir", str(run), "--nodes", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    srun = next(line for line in p.stdout.splitlines() if line.startswith("srun "))
    words = shlex.split(srun)
    assert words[words.index("--output") + 1] == f"{run}/logs/submitit/%j_%t_log.out"
    assert words[-1] == f"{run}/logs/submitit"
    output = next(line for line in p.stdout.splitlines() if line.startswith("#SBATCH --output="))
    assert shlex.split(output.removeprefix("#SBATCH --output=")) == [f"{run}/logs/submitit/%j_0_log.out"]
    assert not run.exists() and not (tmp_path / "pwned").exists()


def test_dry_run_prints_script_and_plan_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--run-dir", str(run), "--nodes", "3", "--gpus-per-node", "8",
         "--partition", "gpu", "--time", "2:00:00", "--sbatch", "mail-type=END",
         "--set", "cluster.actor_num_gpus=16", "--set", "cluster.rollout_num_gpus=8"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    for line in (
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --time=120",
        "#SBATCH --partition=gpu",
        "#SBATCH --mail-type=END",
    ):
        assert line in p.stdout
    assert "node0..node1 (2 nodes): actor ranks 0-15 on gpu0-7" in p.stdout
    assert "node2: engines 0-7 on gpu0-7" in p.stdout and "sit idle" not in p.stdout
    assert not run.exists()


def test_dry_run_names_idle_gpus_of_a_fixed_split(tmp_path):
    base = [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--run-dir", str(tmp_path / "run"),
            "--nodes", "2", "--gpus-per-node", "4"]  # fmt: skip
    p = subprocess.run(base, capture_output=True, text=True, timeout=120)  # the default config leaves the split open
    assert p.returncode == 0 and "4 actor rank(s), 4 engine(s)" in p.stdout and "sit idle" not in p.stdout, p.stdout
    p = subprocess.run([*base, "--set", "cluster.actor_num_gpus=1", "--set", "cluster.rollout_num_gpus=1"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "6 of the 8 GPUs sit idle" in p.stdout and "--nodes 1 --gpus-per-node 2" in p.stdout, p.stdout


def test_dry_run_needs_no_slurm_on_this_machine(tmp_path):
    args = [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--run-dir", str(tmp_path / "run"),
            "--gpus-per-node", "8", "--partition", "gpu"]  # fmt: skip
    empty = tmp_path / "bin"  # a PATH without srun, sinfo or sbatch: a laptop
    empty.mkdir()
    laptop = subprocess.run(args, capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": str(empty)})
    assert laptop.returncode == 0, laptop.stderr
    assert "#SBATCH --partition=gpu" in laptop.stdout and "srun --unbuffered" in laptop.stdout
    here = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert here.stdout == laptop.stdout  # the preview is the same script, srun or not


def test_the_dry_run_shows_each_engines_and_the_routers_command_and_environment_never_a_key(tmp_path):
    """Issue 40: what a site admin checks before a large job queues. A run dir resumed holds last
    start's engine key (a new one is written at each start): its path may show, its content never,
    nor any of the job's own environment but what rlhpc changes."""
    from rlhpc.wire.engine_key import new_key

    run = tmp_path / "run"
    run.mkdir()
    key = new_key(run / "engine_key")
    before = sorted(run.rglob("*"))
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "HF_TOKEN": "hf_not_to_be_shown"}
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--run-dir", str(run), "--nodes", "1",
         "--gpus-per-node", "4", "--set", "rollout.backend=sglang", "--set", "cluster.colocate=true",
         "--set", "cluster.rollout_gpus_per_engine=2", "--set", "deterministic=true",
         "--set", "reward_model.tiny.seed=1"],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert key not in out + p.stderr and "hf_not_to_be_shown" not in out and sorted(run.rglob("*")) == before

    def shown(header: str) -> tuple[str, str]:
        """The command line (placeholders <...> shown unquoted) and the environment's changes."""
        lines = out.split(header + "\n", 1)[1].splitlines()
        assert lines[1].strip().startswith("environment (what rlhpc sets")
        return lines[0].strip(), lines[2].strip() if lines[1].rstrip().endswith(":") else lines[1].split(": ")[-1]

    cmd, changes = shown("engine 0's launch line (each engine's alike):")
    assert cmd.startswith("python -P -m sglang.launch_server ") and " --tp-size 2 " in cmd
    assert " --enable-memory-saver " in cmd and " --enable-deterministic-inference " in cmd
    assert cmd.endswith(" --config <engine tmp dir>/sglang_key.yaml")  # the key's file, written on the node
    assert changes.split() == [
        "CUDA_VISIBLE_DEVICES=<its", "GPUs>", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false",
        "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=false", "SGLANG_RETURN_ORIGINAL_LOGPROB=true",
        "-PYTORCH_CUDA_ALLOC_CONF",
    ]  # fmt: skip
    cmd, changes = shown("reward engine 0's launch line (each reward engine's alike):")  # a CPU engine
    assert cmd.startswith("python -P -m rlhpc.engine_server.cpu ") and cmd.endswith(" --enable-deterministic-inference")
    assert f" --api-key-file {run / 'engine_key'} " in cmd
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB=true" in changes and "PYTORCH_CUDA_ALLOC_CONF" not in changes
    cmd, changes = shown("the router's launch line (on the driver's node):")
    assert f" --api-key-file {run / 'engine_key'} " in cmd and " --api-key " not in cmd and changes == "none"


@pytest.mark.parametrize("router", [True, False])
def test_the_dry_run_shows_the_router_in_front_of_cpu_engines_as_the_job_starts_it(tmp_path, router):
    """``rollout.sglang.router`` puts the real router in front of CPU engines too (issue 40)."""
    from rlhpc.config import load_config
    from rlhpc.launch.preview import engines_preview
    from rlhpc.run_dir import RunDir

    cfg = load_config(None, ["model.tiny={}", f"rollout.sglang.router={str(router).lower()}"])
    assert cfg.rollout.backend == "cpu"
    out = engines_preview(cfg, RunDir(tmp_path / "run"))
    assert "python -P -m rlhpc.engine_server.cpu " in out
    assert ("the router's launch line" in out) == router, out
    if router:
        assert " --disable-health-check --disable-circuit-breaker --disable-retries" in out


def submit_refused(args: list[str], run: Path) -> str:
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--cluster", "local", "--run-dir", str(run), *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2 and "fix:" in out and "Traceback" not in out, out[-2000:]
    return out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--time", "0"], "--time 0 asks for no time"),
        (["--signal-grace", "-5"], "--signal-grace -5 is negative"),
        (["--time", "2", "--signal-grace", "120"], "is not shorter than the time limit"),
        (["--job-name", "a\n#SBATCH --x"], "--job-name 'a\\n#SBATCH --x' holds a control character"),
        (["--sbatch", "comment=a\nb"], "--sbatch comment"),
        (["--partition", "gpu\t"], "--partition 'gpu\\t' holds a control character"),
    ],
    ids=["time-0", "negative-grace", "grace-over-time", "newline-job-name", "newline-sbatch", "tab-partition"],
)
def test_bad_slurm_options_are_refused_before_anything_is_written(tmp_path, args, message):
    run = tmp_path / "run"
    assert message in submit_refused(args, run)
    assert not run.exists()
    assert message in submit_refused([*args, "--dry-run"], run)  # the preview refuses them too


def test_run_dir_that_is_a_file(tmp_path):
    run = tmp_path / "run"
    run.write_text("mine\n")
    assert "is a file, not a directory" in submit_refused([], run)
    assert run.read_text() == "mine\n"


def test_a_finished_run_says_how_to_go_on_from_make(tmp_path):
    from rlhpc.errors import RunDirError
    from rlhpc.preflight import load_config
    from rlhpc.run_dir import RunDir

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.finished_file.write_text("{}\n")
    with pytest.raises(RunDirError) as e:
        run.check(load_config(REPO / "jobs" / "configs" / "embedded.yaml", []))
    assert "make run RUN_DIR=" in e.value.fix and f"rlhpc-status {run.path}" in e.value.fix
    make = subprocess.run(["make", "-n", "run", "RUN_DIR=runs/exp2"], capture_output=True, text=True, cwd=REPO)
    assert "jobs/submit.py --run-dir runs/exp2" in make.stdout and "plot_metrics.py runs/exp2" in make.stdout


def test_dry_run_refuses_a_layout_bigger_than_the_allocation(tmp_path):
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--nodes", "1", "--gpus-per-node", "4", "--set", "cluster.actor_num_gpus=4"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and "needs 5 GPUs" in p.stderr + p.stdout


def test_large_jobs_get_longer_ray_timeouts_and_every_task_its_open_file_limit():
    from rlhpc.launch.ray_cluster import LARGE_JOB_NODES, scale_env

    assert scale_env(4, {}) == {}  # small jobs keep Ray's defaults (a lost node is seen quickly)
    large = scale_env(LARGE_JOB_NODES, {})
    assert large["RAY_health_check_failure_threshold"] == "10" and "RAY_gcs_rpc_server_reconnect_timeout_s" in large
    assert "RAY_health_check_timeout_ms" not in scale_env(1024, {"RAY_health_check_timeout_ms": "5000"})  # site wins
    # Slurm hands the job the login shell's soft limit: the task raises it to the hard limit
    code = (
        "import resource\n"
        "from rlhpc.launch.ray_cluster import raise_open_file_limit\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "assert raise_open_file_limit()[0] == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_a_heterogeneous_dry_run_adds_the_rollout_component_and_spans_both(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--run-dir", str(run), "--nodes", "1",
         "--gpus-per-node", "4", "--partition", "train", "--rollout-nodes", "2", "--rollout-gpus-per-node", "2",
         "--rollout-partition", "gen", "--account", "proj", "--time", "1:00:00"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    component0, _, component1 = p.stdout.partition("#SBATCH hetjob\n")
    assert "#SBATCH --partition=train" in component0 and "#SBATCH --requeue" in component0
    rollout = [x for x in component1.splitlines() if x.startswith("#SBATCH")]
    assert rollout == [
        "#SBATCH --account=proj",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --no-kill",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --partition=gen",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --time=60",
    ]
    assert "--het-group=0,1" in next(x for x in p.stdout.splitlines() if x.startswith("srun "))
    assert (
        "node0: actor ranks 0-3 on gpu0-3" in p.stdout and "node1..node2 (2 nodes): engines 0-3 on gpu0-1" in p.stdout
    )
    assert not run.exists()


def test_a_reward_component_is_the_third_and_srun_spans_all_three(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--run-dir", str(run), "--nodes", "1",
         "--gpus-per-node", "2", "--partition", "train", "--rollout-nodes", "2", "--rollout-gpus-per-node", "1",
         "--rollout-partition", "gen", "--reward-nodes", "1", "--reward-gpus-per-node", "2",
         "--reward-partition", "score", "--set", "reward_model.tiny.seed=1", "--set", "reward_model.num_gpus=2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    _, rollout, reward = p.stdout.split("#SBATCH hetjob\n")
    assert "#SBATCH --partition=gen" in rollout and "#SBATCH --nodes=2" in rollout
    reward = [x for x in reward.splitlines() if x.startswith("#SBATCH")]
    assert "#SBATCH --partition=score" in reward and "#SBATCH --nodes=1" in reward
    assert "#SBATCH --gpus-per-node=2" in reward and "#SBATCH --signal=USR2@120" in reward
    assert "--het-group=0,1,2" in next(x for x in p.stdout.splitlines() if x.startswith("srun "))
    assert "node3: reward engines 0-1 on gpu0-1" in p.stdout
    assert not run.exists()


@pytest.mark.parametrize(
    "env,groups",
    [
        ({}, [None] * 4),
        ({"SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "3"}, [0, 1, 1, 1]),
        (
            {"SLURM_HET_SIZE": "3", "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "2",
             "SLURM_NTASKS_HET_GROUP_2": "1"},
            [0, 1, 1, 2],
        ),
    ],
    ids=["homogeneous", "two-components", "three-components"],
)  # fmt: skip
def test_a_tasks_component_is_read_from_srun_task_counts(monkeypatch, env, groups):
    for key in ("SLURM_HET_SIZE", *(f"SLURM_NTASKS_HET_GROUP_{g}" for g in range(3))):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert [het_group(rank) for rank in range(4)] == groups


def test_a_homogeneous_script_has_no_second_component(tmp_path):
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0 and "hetjob" not in p.stdout and "--het-group" not in p.stdout, p.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--rollout-nodes", "1"], "a local run has one node"),
        (["--rollout-nodes", "1", "--sweep", "seed=1,2"], "--sweep with --rollout-nodes"),
        (["--rollout-gpus-per-node", "2"], "cluster.rollout_gpus_per_node is set but cluster.rollout_nodes is not"),
        (["--rollout-nodes", "1", "--set", "cluster.colocate=true"], "cluster.colocate with cluster.rollout_nodes"),
        (["--rollout-nodes", "1", "--set", "cluster.rollout_num_gpus=4"],
         "cluster.rollout_num_gpus = 4 but its component has 2 GPUs"),
        (["--rollout-nodes", "1", "--rollout-partition", "gen x"], "cluster.rollout_partition = 'gen x' is not a partition"),
        (["--reward-nodes", "1", "--set", "reward_model.tiny.seed=1"], "cluster.reward_nodes without cluster.rollout_nodes"),
    ],
    ids=["local", "sweep", "gpus-without-nodes", "colocate", "too-many-rollout-gpus", "bad-partition",
         "reward-without-rollout"],
)  # fmt: skip
def test_bad_heterogeneous_requests_are_refused_before_anything_is_written(tmp_path, args, message):
    run = tmp_path / "run"
    assert message in submit_refused(args, run)
    assert not run.exists()


@pytest.mark.parametrize("backend", ["cpu", "sglang"])
def test_the_dry_run_shows_the_lora_flags_the_engines_start_with(tmp_path, backend):
    """With ``actor.lora.push: adapter`` the trained engines serve the run's adapter: the dry run's
    launch line carries the flags the job passes (``LoraServing.for_run``, as the driver builds it)."""
    from rlhpc.config import load_config
    from rlhpc.launch.preview import engines_preview
    from rlhpc.run_dir import RunDir
    from rlhpc.wire.lora import LoraServing

    on = [
        "model.tiny={}",
        f"rollout.backend={backend}",
        "actor.lora.rank=8",
        "actor.lora.target_modules=[q_proj, v_proj]",
    ]
    cfg = load_config(None, on)
    flags = " ".join(LoraServing.for_run(cfg.actor.lora).flags())
    assert "--enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj" in flags
    assert flags in engines_preview(cfg, RunDir(tmp_path / "run"))
    plain = load_config(None, on[:2])
    assert LoraServing.for_run(plain.actor.lora) is None
    assert "--enable-lora" not in engines_preview(plain, RunDir(tmp_path / "run"))
