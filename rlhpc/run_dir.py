"""A run's directory: the one place a job's config, model, checkpoints, logs and metrics live.

Every path under a run dir is named here, and only here::

  RUN_DIR/
    config.yaml            the resolved config (written before submission)
    layout.txt             the full GPU map: node/GPU of every actor rank and engine (the log has a summary)
    base_model/            the tiny model built at submit time, when ``model.tiny`` is used
    reward_model/          the tiny classifier (or judge) built at submit time, when ``reward_model.tiny`` is used
    teacher/               the tiny teacher built at submit time, when ``teacher.tiny`` is used
    engine_model_fp8/      rollout.quantization: fp8: the model quantized to block FP8, the engines' start
                           (written by the first start, rlhpc/weights/fp8.py)
    checkpoints/           see rlhpc/checkpoint.py
    metrics.jsonl          one JSON object per rollout and per eval (rlhpc/metrics.py)
    metrics.png            tools/plot_metrics.py's default output
    rollouts/              rollout_NNNNNN.h5: one HDF5 dump per rollout id (logging.dump_rollouts)
    tool_journal/          every tool call's answer of the rollouts since the oldest kept checkpoint,
                           replayed on resume (rollout.tool_journal; rlhpc/rollout/journal.py)
    restarts.jsonl         one line per start of the job (rlhpc/runtime/restarts.py)
    startup.jsonl          one line per start-up phase of every start (rlhpc/runtime/startup.py)
    slurm_job_id           the job id, written at submission (jobs/status.py reads it)
    engine_key             the engine key (0600), new at every start (rlhpc/wire/engine_key.py)
    owner.json             the job that owns the run dir, one at a time (rlhpc/launch/run_owner.py)
    ray/job_ID.ATTEMPT/    one Ray state dir per Slurm job and attempt (JobRayState):
                           auth_token (0600), head.json, node_N.json, ray_node_N.log, stop
    logs/submitit/         submitit's pickles and per-task stdout/stderr
    logs/engines/          engine server logs
    logs/then/             the --then follow-up jobs: submitit's files and their logs
    wandb/                 wandb's own files (logging.wandb_mode)
    FINISHED               written when the last rollout is saved

A sweep dir (``--sweep``, SweepDir) holds one run dir per task and the array's own files::

  SWEEP_DIR/
    sweep.json             the tasks: index, overrides, run dir name (written before submission)
    task_NNN/              a run dir, as above, with the task's overrides in its config.yaml
    slurm_job_id           the array's job id
    logs/submitit/         the array's submitit files and per-task logs (ID_TASK_0_log.out)
    metrics.png            tools/plot_metrics.py's overlay of the tasks
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlhpc.config import Config, TinyModelConfig, config_to_dict, dump_config
from rlhpc.errors import RunDirError
from rlhpc.util.files import apply_access, private_dir, write_atomic

# Changing these between submissions of the same run keeps a resume meaningful.
RESUMABLE_CHANGES = (
    "rollout.num_rollout",
    "rollout.num_epoch",
    "eval.",
    "logging.",
    "checkpoint.save_interval",
    "checkpoint.keep_last",
    "cluster.stage_dir",  # where the inputs are read from changes nothing a run computes
    "cluster.stage_with",
)


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(old: dict, new: dict) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


@dataclass(frozen=True)
class JobRayState:
    """Files a Slurm job's tasks use to find each other (one dir per job and attempt)."""

    root: Path

    @property
    def attempt(self) -> int:
        return int(self.root.suffix[1:])

    @property
    def token(self) -> Path:
        return self.root / "auth_token"

    @property
    def head(self) -> Path:
        return self.root / "head.json"

    @property
    def stop(self) -> Path:
        return self.root / "stop"

    def node(self, rank: int) -> Path:
        return self.root / f"node_{rank}.json"

    def nodes(self) -> list[Path]:
        """The node files of the tasks that started their Ray."""
        return sorted(self.root.glob("node_*.json"))

    def log(self, rank: int) -> Path:
        return self.root / f"ray_node_{rank}.log"


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        self.config_file = self.path / "config.yaml"
        self.layout_file = self.path / "layout.txt"
        self.checkpoints = self.path / "checkpoints"
        self.lora_push = self.path / "lora_push"  # actor.lora.push: adapter: each push's PEFT files, the engines read
        self.logs = self.path / "logs"
        self.base_model = self.path / "base_model"
        self.reward_model = self.path / "reward_model"  # the tiny classifier of reward_model.tiny
        self.teacher_model = self.path / "teacher"  # the tiny causal LM of teacher.tiny
        self.fp8_model = self.path / "engine_model_fp8"  # rollout.quantization: fp8: what the engines start from
        self.finished_file = self.path / "FINISHED"
        self.ended_file = self.path / "ENDED"  # how the last job ended without finishing: failed or held
        self.metrics_file = self.path / "metrics.jsonl"
        self.metrics_plot = self.path / "metrics.png"
        self.rollouts_dir = self.path / "rollouts"
        self.tool_journal = self.path / "tool_journal"
        self.restarts_file = self.path / "restarts.jsonl"
        self.startup_file = self.path / "startup.jsonl"
        self.job_id_file = self.path / "slurm_job_id"
        self.engine_key = self.path / "engine_key"
        self.owner_file = self.path / "owner.json"
        self.ray_root = self.path / "ray"
        self.submitit_dir = self.logs / "submitit"
        self.engine_logs = self.logs / "engines"
        self.followup_dir = self.logs / "then"

    @classmethod
    def of(cls, run: RunDir | str | Path) -> RunDir:
        """``run`` itself, or the run dir at that path (for callers that hold only a path)."""
        return run if isinstance(run, RunDir) else cls(run)

    @classmethod
    def from_submitit_log(cls, log_file: str | Path) -> RunDir | None:
        """The run dir whose ``logs/submitit/`` holds ``log_file`` (e.g. a job's StdOut), else None."""
        log_file = Path(log_file)
        if len(log_file.parents) > 3 and log_file.parent.name == "submitit":
            return cls(log_file.parents[2])
        return None

    def rollout_dump(self, rollout_id: int) -> Path:
        return self.rollouts_dir / f"rollout_{rollout_id:06d}.h5"

    def rollout_dumps(self) -> list[Path]:
        """Every rollout dump, oldest first."""
        return sorted(self.rollouts_dir.glob("rollout_*.h5"))

    def ray_state(self, job_id: str, attempt: int | str) -> JobRayState:
        # One dir per attempt: a requeued job keeps its id, and its tasks must never read the
        # previous attempt's head address or stop file.
        return JobRayState(self.ray_root / f"job_{job_id}.{attempt}")

    @property
    def local_ray_dir_file(self) -> Path:
        """Where a local job records its Ray's temp dir (``local_ray_dir``)."""
        return self.ray_root / "local_ray_dir"

    @property
    def local_ray_dir(self) -> Path | None:
        """Where the run's local Ray keeps (or kept) its sockets and logs, as its last start
        recorded it; None before any. Outside the run dir (Unix socket paths must stay short),
        under a name nobody can tell in advance, so another user cannot make it first (issue 43,
        item 12); recorded, so that what a killed start left there goes at the next one."""
        try:
            return Path(self.local_ray_dir_file.read_text().strip())
        except FileNotFoundError:
            return None

    def latest_ray_state(self, job_id: str) -> JobRayState | None:
        """The newest attempt's Ray state of ``job_id``, None if it never started Ray."""
        attempts = sorted((JobRayState(p) for p in self.ray_root.glob(f"job_{job_id}.*")), key=lambda s: s.attempt)
        return attempts[-1] if attempts else None

    def read_job_id(self) -> str | None:
        return self.job_id_file.read_text().strip() if self.job_id_file.is_file() else None

    def write_job_id(self, job_id: str) -> None:
        write_atomic(self.job_id_file, f"{job_id}\n")

    def __str__(self) -> str:
        return str(self.path)

    def is_finished(self) -> bool:
        return self.finished_file.is_file()

    def mark_ended(self, state: str, job_id: str, reason: str) -> None:
        """The job ended for good without finishing (``failed``, ``held``): what status shows. A
        later start removes it."""
        entry = {"state": state, "job_id": job_id, "reason": reason, "at": time.strftime("%Y-%m-%d %H:%M:%S")}
        write_atomic(self.ended_file, json.dumps(entry) + "\n")

    def read_ended(self) -> dict | None:
        try:
            entry = json.loads(self.ended_file.read_text())
        except (OSError, ValueError):
            return None
        return entry if isinstance(entry, dict) else None

    def model_path(self, cfg: Config) -> str:
        return cfg.model.path if cfg.model.path is not None else str(self.base_model)

    def reward_model_path(self, cfg: Config) -> str | None:
        rm = cfg.reward_model
        if rm is None:
            return None
        return rm.path if rm.path is not None else str(self.reward_model)

    def teacher_path(self, cfg: Config) -> str | None:
        t = cfg.teacher
        if t is None:
            return None
        return t.path if t.path is not None else str(self.teacher_model)

    def config_tree(self) -> dict:
        """The run's saved config as a plain tree: the job types and checks it once, with every rule
        (``rlhpc.preflight.config_from_dict``)."""
        return yaml.safe_load(self.config_file.read_text())

    def check(self, cfg: Config, force: bool = False) -> None:
        """Refuse what would lose or mix results, reading only: a refused command changes nothing."""
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(
                f"run dir {self.path} is a file, not a directory",
                "pass --run-dir a directory (a new one, or the run dir of the run to resume)",
            )
        if self.is_finished():
            raise RunDirError(
                f"run dir {self.path} holds a finished run ({self.finished_file.read_text().strip()})",
                "train again in a new run dir: --run-dir runs/NEW (from make: make run RUN_DIR=runs/NEW); the "
                f"finished run is kept as it is: see it with `rlhpc-status {self.path}`, its plot {self.metrics_plot}",
            )
        if self.config_file.is_file():
            old = yaml.safe_load(self.config_file.read_text())
            changed = [k for k in config_differences(old, config_to_dict(cfg)) if not k.startswith(RESUMABLE_CHANGES)]
            if changed and not force:
                raise RunDirError(
                    f"run dir {self.path} holds a run with a different config ({', '.join(changed)}); resuming it under "
                    "this config would mix two experiments",
                    "pass a new --run-dir, or --force to resume this run under the new config",
                )

    def create(self, access: str = "private") -> None:
        """Make the directory (``Config.run_dir_access``: private or group-readable, and so is
        everything made in it from here on), or say plainly why it cannot be written."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            apply_access(self.path, access)
            probe = self.path / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise RunDirError(
                f"run dir {self.path} is not writable ({e.strerror})", "pass --run-dir on a filesystem you can write to"
            ) from e

    def prepare(self, cfg: Config, force: bool = False) -> None:
        """Create or re-open the run dir for ``cfg``. Refuses what would lose or mix results."""
        self.check(cfg, force)
        self.create(cfg.run_dir_access)
        write_atomic(self.config_file, dump_config(cfg))
        from rlhpc.cluster.layout import describe_layout, plan_layout

        write_atomic(self.layout_file, describe_layout(plan_layout(cfg.cluster, cfg.reward_model, cfg.teacher)) + "\n")
        if cfg.model.tiny is not None and not self.base_model.exists():
            tiny_model(self.base_model, cfg.model.tiny)
        if cfg.reward_model is not None and cfg.reward_model.tiny is not None and not self.reward_model.exists():
            tiny_model(self.reward_model, cfg.reward_model.tiny, classifier=cfg.reward_model.kind == "classifier")
        if cfg.teacher is not None and cfg.teacher.tiny is not None and not self.teacher_model.exists():
            tiny_model(self.teacher_model, cfg.teacher.tiny)
        self.logs.mkdir(exist_ok=True)

    def mark_finished(self, summary: dict) -> None:
        write_atomic(
            self.finished_file, json.dumps({**summary, "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n"
        )


class SweepDir:
    """A sweep's directory: one run dir per task (``task_NNN``) and ``sweep.json`` naming them."""

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        self.spec_file = self.path / "sweep.json"
        self.job_id_file = self.path / "slurm_job_id"
        self.logs = self.path / "logs"
        self.submitit_dir = self.logs / "submitit"
        self.metrics_plot = self.path / "metrics.png"
        # --shared-fleet: the engines the tasks share (rlhpc.launch.fleet), while the sweep runs
        self.fleet_file = self.path / "fleet.json"  # what each task's rollout.fleet names
        self.fleet_key = self.path / "fleet_engine_key"
        self.fleet_logs = self.logs / "fleet"
        self.fleet_model = self.path / "base_model"  # a tiny model's copy the fleet serves

    @staticmethod
    def is_sweep(path: str | Path) -> bool:
        return (Path(path) / "sweep.json").is_file()

    def task(self, index: int) -> RunDir:
        return RunDir(self.path / f"task_{index:03d}")

    def read_spec(self) -> list[list[str]] | None:
        """Each task's overrides, in task order; None when this is no sweep dir (yet)."""
        if not self.spec_file.is_file():
            return None
        return [t["overrides"] for t in json.loads(self.spec_file.read_text())["tasks"]]

    def write_spec(self, tasks: list[list[str]]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        spec = {"tasks": [{"index": i, "overrides": o, "run_dir": self.task(i).path.name} for i, o in enumerate(tasks)]}
        write_atomic(self.spec_file, json.dumps(spec, indent=1) + "\n")

    def write_job_id(self, job_id: str) -> None:
        write_atomic(self.job_id_file, f"{job_id}\n")

    def __str__(self) -> str:
        return str(self.path)


def tiny_model(out: Path, tiny: TinyModelConfig, classifier: bool = False) -> None:
    """A tiny model written to ``out``: copied from this user's cache when one of the same
    config was built before, else built (``rlhpc.model.build_tiny_model``) and cached. The build
    is deterministic in its config, so a copy is the same bytes; a hit spares the submitting
    process torch's and transformers' imports (seconds on a login node, each job). The key
    holds the builder's source and the library versions that shape the files; the cache is
    ``$RLHPC_CACHE_DIR`` or ``~/.cache/rlhpc``, 0700 (``private_dir``: nobody else's files)."""
    cache = tiny_cache_dir()
    key = tiny_model_key(tiny, classifier)
    hit = cache / key if cache is not None else None
    if hit is None or not hit.is_dir():
        from rlhpc.model import build_tiny_model

        if hit is None:
            build_tiny_model(out, tiny, classifier=classifier)
            return
        built = build_tiny_model(cache / f"{key}.{os.getpid()}", tiny, classifier=classifier)
        try:
            built.rename(hit)  # whole or not at all; a concurrent build of the same key wins alike
        except OSError:
            shutil.rmtree(built, ignore_errors=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # Bytes only: copytree would carry the cache's modes, where the run's umask must decide.
    shutil.copytree(hit, tmp, copy_function=shutil.copyfile)
    mode = 0o777 & ~_umask()
    for d in (tmp, *(p for p in tmp.rglob("*") if p.is_dir())):
        os.chmod(d, mode)
    tmp.rename(out)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def tiny_cache_dir() -> Path | None:
    """This user's cache of tiny models, or None where there is no home to keep one in."""
    root = Path(os.environ.get("RLHPC_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "rlhpc")
    root = root.expanduser()
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        return private_dir(private_dir(root) / "tiny")
    except OSError:
        return None  # a read-only or missing home: build into the run dir as before


def tiny_model_key(tiny: TinyModelConfig, classifier: bool) -> str:
    h = hashlib.sha256(json.dumps(dataclasses.asdict(tiny), sort_keys=True).encode())
    h.update(b"classifier" if classifier else b"causal")
    h.update(_builder_source())
    for lib in ("torch", "transformers", "tokenizers", "safetensors"):
        h.update(f"{lib}={importlib.metadata.version(lib)}".encode())
    return h.hexdigest()[:32]


def _builder_source() -> bytes:
    """The builder's source and the tasks' (the BPE vocabulary is trained on their text), read
    without importing them (they import torch)."""
    here = Path(__file__).resolve().parent
    return b"".join((here / f).read_bytes() for f in ("model.py", "data/tasks.py", "data/code.py", "data/guess.py"))
