"""Typed run configuration: one dataclass per component, loaded from YAML + ``--set`` overrides.

The resolved config is the single source of truth for a run: it is written to
``RUN_DIR/config.yaml`` before anything starts, and every component receives the section it
needs as an explicit argument (no global ``args``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from rlhpc.errors import ConfigError
from rlhpc.model import TinyModelConfig


@dataclass
class ClusterConfig:
    """How many GPUs each group gets, and how the job's GPUs are shared between them."""

    num_nodes: int = 1
    gpus_per_node: int = 2  # on a machine without GPUs these are declared to Ray, not real
    actor_num_gpus: int = 1
    rollout_num_gpus: int = 1
    rollout_gpus_per_engine: int = 1
    colocate: bool = False  # actor and engines share the same GPUs
    offload: bool = False  # free engine memory during training (and the actor's during generation)
    ray_start_timeout_s: float = 300.0  # all nodes must join Ray within this, or the job fails naming them


@dataclass
class ModelConfig:
    """The initial policy: an HF directory (``path``) or a tiny random model built at submit."""

    path: str | None = None
    tiny: TinyModelConfig | None = None


@dataclass
class DataConfig:
    """Prompts and the reward function. Without files, the task generates its own data."""

    task: str = "digit_sum"
    train_file: str | None = None  # JSONL of {"prompt": ..., "answer": ...}
    eval_file: str | None = None
    num_train: int = 100
    num_eval: int = 100
    reward: str | None = None  # "module:function" overriding the task's reward
    seed: int = 0


@dataclass
class SGLangConfig:
    """Options of the SGLang servers (``rollout.backend: sglang``); TP = cluster.rollout_gpus_per_engine."""

    mem_fraction_static: float = 0.7  # GPU memory for weights + KV cache (colocate: leave room for the actor)
    router: bool = True  # put sglang_router in front of the engines for generation
    extra_args: list[str] = field(default_factory=list)  # passed to sglang.launch_server as they are


@dataclass
class RolloutConfig:
    backend: Literal["cpu", "sglang"] = "cpu"
    num_rollout: int | None = None  # None: derived from num_epoch and the data size
    num_epoch: int = 1
    rollout_batch_size: int = 32  # prompts per rollout
    n_samples_per_prompt: int = 8
    max_new_tokens: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    update_weight_buffer_mb: int = 512  # bucket size for weight sync
    engine_startup_timeout_s: float = 120.0
    max_engine_restarts: int = 3  # per engine: a dead/unhealthy engine is restarted and re-synced
    sglang: SGLangConfig = field(default_factory=SGLangConfig)


@dataclass
class EvalConfig:
    interval: int | None = None  # evaluate every N rollouts (and at epoch ends); None: never
    n_samples_per_prompt: int = 1
    temperature: float = 0.0
    max_new_tokens: int | None = None  # None: rollout.max_new_tokens


@dataclass
class MegatronConfig:
    """megatron-core options (``actor.backend: megatron``). DP = actor_num_gpus / TP."""

    tensor_model_parallel_size: int = 1
    # Shard optimizer state over data-parallel ranks. Its checkpoints resume at another DP size
    # but the same TP size; the plain optimizer's reshard to any TP/DP.
    use_distributed_optimizer: bool = False
    bf16: bool = False  # bf16 params/compute with fp32 master weights (GPU); fp32 otherwise


@dataclass
class ActorConfig:
    backend: Literal["torch", "megatron"] = "torch"
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    num_steps_per_rollout: int = 1  # optimizer steps (minibatches) per rollout batch
    micro_batch_size: int = 64  # samples per forward/backward on one rank
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class AlgoConfig:
    advantage_estimator: Literal["grpo", "rloo"] = "grpo"
    normalize_std: bool = True
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    kl_coef: float = 0.0  # > 0 adds a k3 KL penalty to the reference model (loaded then)


@dataclass
class CheckpointConfig:
    save_interval: int | None = 10  # save every N rollouts (and at epoch ends); None: only at the end
    keep_last: int = 2
    resume: Literal["auto", "never"] = "auto"
    max_restarts: int = 20  # requeues (preemption, time limit, failure) before the job is held
    max_starts_without_progress: int = 3  # restarts that train no rollout before the job is held
    requeue_on_failure: bool = True  # a crashed job requeues itself (bounded by the two limits above)


@dataclass
class LoggingConfig:
    level: str = "INFO"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "rlhpc"
    dump_rollouts: bool = True  # one HDF5 file per rollout id under RUN_DIR/rollouts/


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 1234
    deterministic: bool = False  # reruns and resumed runs give bit-identical weights (CPU)

    @property
    def kl_needed(self) -> bool:
        return self.algo.kl_coef > 0


# ---------------------------------------------------------------- loading and typing


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where} = {value!r} is not one of {_type_name(tp)}", f"set {where} to one of those")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(
                f"{where} must be a list of {len(args)} values, got {value!r}", f"write e.g. {where}: [0.9, 0.999]"
            )
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}", f"write e.g. {where}: [a, b]")
        return [_coerce(v, arg, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(
            f"{where} must be {_type_name(tp)}, got {type(value).__name__} {value!r}",
            f"fix the value of {where} in the config file or --set",
        )
    return value


def _build(cls: type, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where or 'the config'} must be a mapping, got {type(data).__name__}", "check the YAML indentation"
        )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            fix = (
                f"did you mean {where + '.' if where else ''}{close[0]}?"
                if close
                else f"valid keys: {', '.join(names)}"
            )
            raise ConfigError(f"unknown config key {path!r}", fix)
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(
                f"--set {dotted}: {p!r} is a value, not a section", "set the value itself, e.g. --set seed=1"
            )
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"rollout.temperature=0.7"`` -> ``("rollout.temperature", 0.7)``; values are YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {text!r} is not KEY=VALUE", "write e.g. --set rollout.num_rollout=20")
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read YAML (optional), apply ``--set`` overrides, type-check and validate."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"config file {p} does not exist", "pass an existing YAML file to --config (see jobs/configs/)"
            )
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}", "fix the syntax at the line shown") from e
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict:
    def plain(x: Any) -> Any:
        if isinstance(x, tuple):
            return list(x)
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(dataclasses.asdict(cfg))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def config_from_dict(tree: dict) -> Config:
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- cross-field checks


def validate(cfg: Config) -> None:
    """Checks that need more than one field. Each error names the key and the fix."""
    c = cfg.cluster
    for name in ("num_nodes", "gpus_per_node", "actor_num_gpus", "rollout_num_gpus", "rollout_gpus_per_engine"):
        if getattr(c, name) < 1:
            raise ConfigError(
                f"cluster.{name} = {getattr(c, name)} must be >= 1", f"set cluster.{name} to a positive count"
            )
    if c.rollout_num_gpus % c.rollout_gpus_per_engine:
        raise ConfigError(
            f"cluster.rollout_num_gpus = {c.rollout_num_gpus} is not a multiple of "
            f"cluster.rollout_gpus_per_engine = {c.rollout_gpus_per_engine}",
            "make the rollout GPUs a whole number of engines",
        )
    total = c.num_nodes * c.gpus_per_node
    if c.colocate:
        if c.rollout_num_gpus > c.actor_num_gpus:
            raise ConfigError(
                f"colocate: cluster.rollout_num_gpus = {c.rollout_num_gpus} > cluster.actor_num_gpus = {c.actor_num_gpus}",
                "in colocate mode the engines live on the actor's GPUs: use at most as many rollout GPUs",
            )
        needed = c.actor_num_gpus
    else:
        needed = c.actor_num_gpus + c.rollout_num_gpus
    if needed > total:
        raise ConfigError(
            f"the layout needs {needed} GPUs (actor {c.actor_num_gpus} + rollout {c.rollout_num_gpus}"
            f"{', colocated' if c.colocate else ''}) but the job has {total} "
            f"(cluster.num_nodes={c.num_nodes} x cluster.gpus_per_node={c.gpus_per_node})",
            "ask for more nodes/GPUs, or shrink cluster.actor_num_gpus / cluster.rollout_num_gpus",
        )
    if c.rollout_gpus_per_engine > c.gpus_per_node and c.rollout_gpus_per_engine % c.gpus_per_node:
        raise ConfigError(
            f"cluster.rollout_gpus_per_engine = {c.rollout_gpus_per_engine} spans nodes unevenly "
            f"(gpus_per_node = {c.gpus_per_node})",
            "use a divisor or a multiple of cluster.gpus_per_node",
        )

    m = cfg.model
    if (m.path is None) == (m.tiny is None):
        raise ConfigError(
            "set exactly one of model.path and model.tiny",
            "point model.path at an HF model directory, or use model.tiny for a random toy model",
        )
    if m.path is not None and not (Path(m.path) / "config.json").is_file():
        raise ConfigError(
            f"model.path {m.path} has no config.json",
            "point model.path at a Hugging Face model directory (config.json + safetensors)",
        )

    d = cfg.data
    for key in ("train_file", "eval_file"):
        f = getattr(d, key)
        if f is not None and not Path(f).is_file():
            raise ConfigError(
                f"data.{key} {f} does not exist", f"create it (JSONL with prompt/answer) or unset data.{key}"
            )
    from rlhpc.tasks import TASKS, resolve_reward  # late: tasks import torch-free helpers only

    if d.task not in TASKS:
        raise ConfigError(f"data.task = {d.task!r} is not a known task", f"use one of: {', '.join(sorted(TASKS))}")
    if d.reward is not None:
        resolve_reward(d.reward)

    r = cfg.rollout
    if r.num_rollout is not None and r.num_rollout < 1:
        raise ConfigError(
            f"rollout.num_rollout = {r.num_rollout} must be >= 1",
            "set a positive count, or null to derive it from rollout.num_epoch",
        )
    for key in ("num_epoch", "rollout_batch_size", "n_samples_per_prompt", "max_new_tokens", "update_weight_buffer_mb"):
        if getattr(r, key) < 1:
            raise ConfigError(
                f"rollout.{key} = {getattr(r, key)} must be >= 1", f"set rollout.{key} to a positive number"
            )
    if cfg.algo.advantage_estimator == "rloo" and r.n_samples_per_prompt < 2:
        raise ConfigError(
            "algo.advantage_estimator = 'rloo' needs rollout.n_samples_per_prompt >= 2",
            "sample at least 2 responses per prompt",
        )
    if r.rollout_batch_size * r.n_samples_per_prompt < c.actor_num_gpus:
        raise ConfigError(
            f"a rollout has {r.rollout_batch_size * r.n_samples_per_prompt} samples, fewer than the {c.actor_num_gpus} actor ranks",
            "raise rollout.rollout_batch_size or lower cluster.actor_num_gpus",
        )
    if r.max_engine_restarts < 0:
        raise ConfigError(
            f"rollout.max_engine_restarts = {r.max_engine_restarts} must be >= 0", "set 0 to never restart an engine"
        )
    if not 0 < r.sglang.mem_fraction_static < 1:
        raise ConfigError(
            f"rollout.sglang.mem_fraction_static = {r.sglang.mem_fraction_static} must be in (0, 1)",
            "give SGLang a share of each GPU, e.g. 0.7 (colocate: leave room for the actor, e.g. 0.4)",
        )
    if cfg.actor.backend == "megatron":
        _validate_megatron(cfg)
    if cfg.eval.interval is not None and cfg.eval.interval < 1:
        raise ConfigError(
            f"eval.interval = {cfg.eval.interval} must be >= 1", "set a positive interval, or null to disable eval"
        )
    ck = cfg.checkpoint
    if ck.save_interval is not None and ck.save_interval < 1:
        raise ConfigError(
            f"checkpoint.save_interval = {ck.save_interval} must be >= 1",
            "set a positive interval, or null to save only at the end",
        )
    if ck.keep_last < 2:
        raise ConfigError(
            f"checkpoint.keep_last = {ck.keep_last} must be >= 2",
            "keep at least two, so a damaged newest checkpoint still leaves one to resume from",
        )
    if cfg.actor.num_steps_per_rollout < 1 or cfg.actor.micro_batch_size < 1:
        raise ConfigError("actor.num_steps_per_rollout and actor.micro_batch_size must be >= 1", "set positive values")


def _model_shape(cfg: Config) -> tuple[int, int, int] | None:
    """(attention heads, kv heads, ffn size) of the configured model, or None if unreadable."""
    if cfg.model.tiny is not None:
        t = cfg.model.tiny
        return t.num_attention_heads, t.num_key_value_heads, t.intermediate_size
    try:
        hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
        heads = hf["num_attention_heads"]
        return heads, hf.get("num_key_value_heads") or heads, hf["intermediate_size"]
    except (OSError, ValueError, KeyError):
        return None


def _validate_megatron(cfg: Config) -> None:
    c, tp = cfg.cluster, cfg.actor.megatron.tensor_model_parallel_size
    if tp < 1:
        raise ConfigError(f"actor.megatron.tensor_model_parallel_size = {tp} must be >= 1", "use 1, 2, 4 or 8")
    if c.actor_num_gpus % tp:
        raise ConfigError(
            f"actor.megatron.tensor_model_parallel_size = {tp} does not divide cluster.actor_num_gpus = {c.actor_num_gpus}",
            "make the actor GPUs a multiple of the TP size (data parallel = actor GPUs / TP)",
        )
    if tp > c.gpus_per_node:
        raise ConfigError(
            f"actor.megatron.tensor_model_parallel_size = {tp} > cluster.gpus_per_node = {c.gpus_per_node}: "
            "tensor parallelism across nodes",
            "keep TP within a node (TP <= gpus_per_node); scale across nodes with data parallelism",
        )
    shape = _model_shape(cfg)
    if shape is not None:
        heads, kv_heads, ffn = shape
        if heads % tp or kv_heads % tp or ffn % tp:
            raise ConfigError(
                f"actor.megatron.tensor_model_parallel_size = {tp} does not divide the model's attention heads "
                f"({heads}), key/value heads ({kv_heads}) or FFN size ({ffn})",
                "choose a TP size that divides all three",
            )
