"""Every check a run gets before anything is submitted or written, in one order.

``rlhpc.config`` holds the rules that need nothing but the config; the checks that need the code a
config names sit where that code resolves it (the task and its data files in ``rlhpc.data``, the
reward in ``rlhpc.rollout.scoring``, the environment, tools, generate function, agent and judge in
``rlhpc.rollout``, the layout and the memory plan in ``rlhpc.cluster``, the models the megatron actor
builds in ``rlhpc.actor.megatron.support``). This module, above them all,
runs both kinds in the order a reader meets the config: the groups, the model, the data, the way
in, the algorithm, the parallel sizes, and last the memory estimate, which reads what came before.
Every entry point (submit, dry run, sweeps, the job's start, evaluation) loads a config here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from rlhpc import config
from rlhpc.actor.megatron.support import check_model as check_megatron_model
from rlhpc.cluster.layout import check_homes
from rlhpc.cluster.memory import check_fits
from rlhpc.config import Config
from rlhpc.data.dynamic_sampling import resolve_filter
from rlhpc.data.files import check_exist, check_rows
from rlhpc.data.images import is_vision_model
from rlhpc.data.tasks import TASKS, check_scored, check_task, task_env
from rlhpc.errors import ConfigError
from rlhpc.rollout.episodes import check_env
from rlhpc.rollout.scoring import check_reward
from rlhpc.rollout.trajectories import check_custom
from rlhpc.wire.lora import SUPPORTED_TARGET_MODULES
from rlhpc.wire.protocol import ROUTER_VERSION


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """``rlhpc.config.load_config`` with every check of :func:`check`."""
    return config_from_dict(config.load_tree(path, overrides))


def config_from_dict(tree: dict) -> Config:
    """``rlhpc.config.config_from_dict`` with every check of :func:`check`."""
    cfg = config.build_config(tree)
    check(cfg)
    return cfg


def check(cfg: Config) -> None:
    """The whole config is usable: ``rlhpc.config.validate``'s rules and, among them, the checks that
    import or read what the config names. Resolves an open GPU split in place (``config.place_groups``)."""
    config.check_sections(cfg)
    config.resolve_defaults(cfg)
    check_task(cfg.data)
    config.place_groups(cfg)
    config.check_groups(cfg)
    check_homes(cfg)
    if cfg.reward_model is not None and cfg.reward_model.kind == "judge":
        # imported at submit, as data.reward is: a typo fails here, not on the cluster; late, as
        # it imports torch, which only a judge run needs here
        from rlhpc.rollout.judge import resolve_judge

        resolve_judge(cfg.reward_model)
    config.check_model(cfg)
    check_vision(cfg)
    check_megatron_model(cfg)
    check_lora(cfg)
    check_fleet(cfg)
    check_routing_replay(cfg)
    check_fp8(cfg)
    _check_data(cfg)
    r, env = cfg.rollout, task_env(cfg.data, cfg.rollout)
    if r.generate_fn is not None or r.agent is not None:
        check_custom(cfg, env)
    elif env is not None or r.tools:
        check_env(cfg, env)
    config.check_overlong(cfg, env)
    config.check_run(cfg)
    config.check_parallelism(cfg)
    check_fits(cfg)  # last: the estimate reads the layout and the model's shape checked above


def check_fp8(cfg: Config) -> None:
    """rollout.quantization: fp8 on a model SGLang can serve in block FP8: its projections fit
    the 128 x 128 blocks at each engine's TP (what SGLang refuses at start), no vision tower,
    and with the CPU engine no fused MoE experts (not built in FP8 there)."""
    if cfg.rollout.quantization is None:
        return
    from rlhpc.model import weight_bytes  # late, as fp8
    from rlhpc.weights import fp8  # late: it imports torch

    tiny, tp = cfg.model.tiny, cfg.cluster.rollout_gpus_per_engine
    where = "model.tiny" if tiny is not None else f"model.path {cfg.model.path}"
    if (tiny.architecture == "qwen2_5_vl") if tiny is not None else is_vision_model(cfg.model.path):
        raise ConfigError(
            f"rollout.quantization: fp8 with {where}, a vision-language model: rlhpc quantizes language models only",
            "drop rollout.quantization for vision-language models",
        )
    if tiny is not None:
        shapes = fp8.tiny_shapes(tiny)
    else:
        shapes = fp8.checkpoint_shapes(cfg.model.path)
        if not shapes and not weight_bytes(cfg.model.path):  # a config.json alone (a dry run before the download)
            shapes = fp8.config_shapes(cfg.model.path)
    problems = fp8.block_problems(shapes, tp if cfg.rollout.backend == "sglang" else 1)
    if not any(fp8.quantizes(n, s) for n, s in shapes.items()):
        problems = ["none of its weights is a layer projection SGLang quantizes"]
    if problems:
        raise ConfigError(
            f"rollout.quantization: fp8: SGLang's {fp8.BLOCK[0]}x{fp8.BLOCK[1]} FP8 blocks do not fit {where} "
            f"at {tp} GPU(s) per engine: {'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}",
            "use a model whose projections are multiples of 128 rows per engine rank (fewer "
            "cluster.rollout_gpus_per_engine), or drop rollout.quantization",
        )
    moe = any(".mlp.experts." in n for n in shapes)
    if moe and cfg.rollout.backend == "cpu":
        raise ConfigError(
            f"rollout.quantization: fp8 with {where}, a MoE model, on the CPU engine: it holds fused experts, "
            "which it does not build in FP8",
            "use rollout.backend: sglang for FP8 MoE rollout, or drop rollout.quantization",
        )


def check_vision(cfg: Config) -> None:
    """A vision-language model trains with the torch actor; the squares task needs one; images
    are single-turn (an episode, a generate function or an agent cannot take them yet)."""
    tiny = cfg.model.tiny
    vlm = tiny.architecture == "qwen2_5_vl" if tiny is not None else is_vision_model(cfg.model.path)
    model = "model.tiny.architecture = qwen2_5_vl" if tiny is not None else f"model.path {cfg.model.path}"
    if vlm and cfg.actor.backend == "megatron":
        raise ConfigError(
            f"{model} is a vision-language model, which the megatron actor cannot train yet (its model "
            "builder has no vision tower)",
            "use actor.backend: torch (docs/guides/multimodal.md)",
        )
    task = TASKS[cfg.data.task]
    if task.images and cfg.data.train_file is None and not vlm:
        raise ConfigError(
            f"data.task = {cfg.data.task} shows the model pictures, but {model} takes none",
            "set model.tiny.architecture: qwen2_5_vl and model.tiny.tokenizer: bpe, or a vision-language model.path",
        )
    r = cfg.rollout
    multi = r.env or r.tools or r.generate_fn or r.agent or task.env
    if task.images and multi:
        raise ConfigError(
            f"data.task = {cfg.data.task} has images, which multi-turn rollouts (rollout.env, tools, a "
            "generate function, an agent) cannot take yet",
            "run it single-turn (unset rollout.env, rollout.tools, rollout.generate_fn, rollout.agent)",
        )


def check_routing_replay(cfg: Config) -> None:
    """``algo.routing_replay`` fits the run: a Qwen3-MoE model (the routers both actors replay),
    single-turn generation straight to the engines (sglang_router 0.3.2 drops the request's
    return_routed_experts; an episode's observation tokens and a partial rollout's earlier
    weights have no engine routing to replay yet)."""
    if not cfg.algo.routing_replay:
        return
    tiny = cfg.model.tiny
    model = f"model.tiny.architecture = {tiny.architecture}" if tiny is not None else f"model.path {cfg.model.path}"
    kind = tiny.architecture if tiny is not None else _hf_config(Path(cfg.model.path)).get("model_type")
    if kind != "qwen3_moe":
        raise ConfigError(
            f"algo.routing_replay is true, but {model} is not a mixture-of-experts model the actor can replay "
            f"(model type {kind!r}; routing replay replays Qwen3-MoE's routers)",
            "set algo.routing_replay: false (a dense model has no routing to replay), or train a Qwen3-MoE model",
        )
    r, task = cfg.rollout, TASKS[cfg.data.task]
    if r.sglang.router:  # the CPU engines sit behind it too
        raise ConfigError(
            f"algo.routing_replay is true with rollout.sglang.router: true, and sglang_router {ROUTER_VERSION} "
            "does not pass the request's return_routed_experts on to the engines",
            "set rollout.sglang.router: false (requests go to the engines directly)",
        )
    if r.env or r.tools or r.generate_fn or r.agent or task.env:
        raise ConfigError(
            "algo.routing_replay is true with a multi-turn rollout (rollout.env, tools, a generate function or "
            "an agent), whose observation tokens no engine routed",
            "run single-turn (unset those), or set algo.routing_replay: false",
        )
    m = cfg.actor.megatron
    if cfg.actor.backend == "megatron" and m.recompute and m.pipeline_model_parallel_size > 1:
        raise ConfigError(
            "algo.routing_replay is true with actor.megatron.recompute: true and pipeline stages: the pipeline "
            "schedule runs later micro-batches' forwards (which set the routers' experts) before a backward "
            "recomputes an earlier one's layers",
            "set actor.megatron.recompute: false or pipeline_model_parallel_size: 1, or algo.routing_replay: false",
        )
    if r.partial_rollout:
        raise ConfigError(
            "algo.routing_replay is true with rollout.partial_rollout: true (a sample's tokens from two weight "
            "versions, routed by both)",
            "set rollout.partial_rollout: false (the fixed-lag async pipeline replays), or algo.routing_replay: false",
        )


# The linear layers of a tiny dense model's decoder layer (rlhpc.model builds them as transformers names them).
TINY_LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def check_lora(cfg: Config) -> None:
    """``actor.lora`` fits the run: a dense text model (peft wraps a MoE's fused experts and a
    vision tower in ways the weight push does not follow yet), no reference resets (the
    reference is the base model with the adapters off), and every module named in
    ``target_modules`` is one the model has (read from its weights' names, without torch)."""
    lora = cfg.actor.lora
    if lora is None:
        return
    tiny = cfg.model.tiny
    model = f"model.tiny.architecture = {tiny.architecture}" if tiny is not None else f"model.path {cfg.model.path}"
    hf = {} if tiny is not None else _hf_config(Path(cfg.model.path))
    moe = (
        tiny.architecture == "qwen3_moe"
        if tiny is not None
        else bool(hf.get("num_experts") or hf.get("n_routed_experts"))
    )
    vlm = tiny.architecture == "qwen2_5_vl" if tiny is not None else is_vision_model(cfg.model.path)
    if moe or vlm:
        raise ConfigError(
            f"actor.lora is set, but {model} is a {'mixture-of-experts' if moe else 'vision-language'} model, "
            "which rlhpc's LoRA does not train yet (dense text models only)",
            "unset actor.lora (full fine-tuning), or train a dense text model (llama, qwen2, qwen3) with LoRA",
        )
    if cfg.algo.ref_update_interval:
        raise ConfigError(
            f"algo.ref_update_interval = {cfg.algo.ref_update_interval} with actor.lora: the reference model is "
            "the base model with the adapters off, which cannot be reset to the policy",
            "set algo.ref_update_interval: 0 (the reference stays the base model), or unset actor.lora",
        )
    if lora.target_modules != "all-linear":
        _check_targets(cfg)
    if lora.push == "adapter":
        _check_adapter_push(cfg)


def check_fleet(cfg: Config) -> None:
    """``rollout.fleet``: a run on a shared fleet pushes its adapter alone, under its own name (a
    merged push would change every run's base weights), in the synchronous loop (a push unloads
    the adapter that generation ahead of training would still name)."""
    if cfg.rollout.fleet is None:
        return
    lora = cfg.actor.lora
    if lora is None or lora.push != "adapter":
        raise ConfigError(
            f"rollout.fleet is set, but the run {'trains no LoRA adapter' if lora is None else 'pushes merged weights'}"
            ": the engines of a shared fleet serve each run's adapter beside the others', on one base model",
            "set actor.lora (with actor.lora.push: adapter), or unset rollout.fleet to start the run's own engines",
        )
    if cfg.rollout.max_staleness:
        raise ConfigError(
            f"rollout.fleet with rollout.max_staleness = {cfg.rollout.max_staleness}: a push unloads the "
            "adapter that generation running ahead of training still names",
            "set rollout.max_staleness: 0 (the synchronous loop), or unset rollout.fleet",
        )


def _check_targets(cfg: Config) -> None:
    """Every module named in ``actor.lora.target_modules`` is one the model has."""
    lora, tiny = cfg.actor.lora, cfg.model.tiny
    model = f"model.tiny.architecture = {tiny.architecture}" if tiny is not None else f"model.path {cfg.model.path}"
    if tiny is not None:
        modules = [f"model.layers.{i}.{m}" for i in range(tiny.num_hidden_layers) for m in TINY_LINEAR]
        modules += ["model.embed_tokens", "lm_head"]
    else:
        modules = _weight_modules(Path(cfg.model.path))
        if modules is None:
            return  # no safetensors to read here: the rank's peft refuses an unknown name at start
    missing = [t for t in lora.target_modules if not any(m == t or m.endswith("." + t) for m in modules)]
    if missing:
        leaves = sorted({m.rsplit(".", 1)[-1] for m in modules if ".layers." in m})
        raise ConfigError(
            f"actor.lora.target_modules names {', '.join(missing)}, which {model} does not have",
            f"name its linear layers as peft does ({', '.join(leaves)}), or write actor.lora.target_modules: all-linear",
        )


def _check_adapter_push(cfg: Config) -> None:
    """The engines can serve the adapter a push loads: modules SGLang adapts, and no request
    retracted across a push (it would come back to an adapter unloaded under it)."""
    lora = cfg.actor.lora
    if cfg.rollout.partial_rollout:
        raise ConfigError(
            "actor.lora.push = adapter with rollout.partial_rollout = true: a push unloads the adapter the "
            "requests retracted across it still name",
            "set actor.lora.push: merged (full weights, as without LoRA), or rollout.partial_rollout: false",
        )
    if isinstance(lora.target_modules, list):
        unserved = [m for m in lora.target_modules if m not in SUPPORTED_TARGET_MODULES]
        if unserved:
            raise ConfigError(
                f"actor.lora.target_modules names {', '.join(unserved)}, which SGLang does not serve adapters "
                "on, and actor.lora.push = adapter has the engines serve the adapter",
                f"set actor.lora.push: merged (full weights), or adapt only modules SGLang serves "
                f"({', '.join(SUPPORTED_TARGET_MODULES)})",
            )


def _hf_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _weight_modules(path: Path) -> list[str] | None:
    """The modules of an HF directory's matrices (2-D weights), from its safetensors headers;
    None where it has no safetensors."""
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():  # sharded: the index names every tensor (no shapes)
            names = json.loads(index.read_text())["weight_map"]
            return [n.removesuffix(".weight") for n in names if n.endswith(".weight")]
        with open(path / "model.safetensors", "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, KeyError):
        return None
    return [
        n.removesuffix(".weight")
        for n, e in header.items()
        if n.endswith(".weight") and isinstance(e, dict) and len(e.get("shape", ())) == 2
    ]


def _check_data(cfg: Config) -> None:
    """The data files exist, are scored by a reward that knows them, and read; the reward imports;
    the dynamic sampling filter resolves."""
    config.check_data(cfg)
    files = config.data_files(cfg)
    check_exist(files)
    check_scored(cfg.data, files, task_env(cfg.data, cfg.rollout))
    config.check_chat_template(cfg)
    check_rows(
        files, cfg.data.chat_template, cfg.data.image_key
    )  # a bad file is refused here, at submit, not after the queue wait
    check_reward(cfg.data)
    if cfg.rollout.dynamic_sampling.filter is not None:
        resolve_filter(cfg.rollout.dynamic_sampling.filter)
