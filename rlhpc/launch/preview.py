"""The dry run: the sbatch script, the GPU plan, the memory estimate and the engines' and the
router's launch lines and environments, without submitting or writing anything."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from rlhpc.cluster import memory, timing
from rlhpc.cluster.layout import idle_note, plan_layout, summarize_layout
from rlhpc.config import Config, dump_config
from rlhpc.launch.slurm import SlurmOptions, sbatch_script, slurm_executor
from rlhpc.run_dir import RunDir


def dry_run(
    cfg: Config, run_dir: Path, opts: SlurmOptions, array: int | None = None, max_parallel: int | None = None
) -> str:
    """The sbatch script and the GPU plan, without submitting (or writing anything); ``array``:
    the script of a sweep's job array of that many tasks (the plan is its first task's)."""
    # submitit's own builder over the real run dir (it writes nothing until a submission): the
    # script shows each path as sbatch gets it, quoted whatever characters it holds.
    executor = slurm_executor(RunDir(run_dir), opts, preview=True, max_parallel=max_parallel)
    script = sbatch_script(executor, array)
    layout = summarize_layout(plan_layout(cfg.cluster, cfg.reward_model, cfg.teacher))
    idle = idle_note(cfg.cluster, cfg.reward_model, cfg.teacher)
    notes = f"\nWARNING: {idle}" if idle else ""
    where = "each task's layout.txt" if array else RunDir(run_dir).layout_file
    engines = engines_preview(cfg, RunDir(run_dir))
    return (
        f"{script}\n\n{layout}\n  full map: {where} (written at submission){notes}\n\n{memory.summarize(cfg)}\n\n{timing.summarize(cfg)}{engines}\n\n"
        f"# the resolved config the job runs (written to {RunDir(run_dir).path / 'config.yaml'}):\n{dump_config(cfg)}"
    )


# What is known only on the node, or only once the job runs, is shown as <...>.
NODE_IP, FREE_PORT, ENGINE_TMP, ENGINE_GPUS = "<node ip>", "<free port>", "<engine tmp dir>", "<its GPUs>"
ENV_NOTE = "environment (what rlhpc sets, over the job's own; -NAME: removed)"


def engines_preview(cfg: Config, run: RunDir) -> str:
    """Each engine group's launch line and environment (engine 0's; the others' alike), and the
    router's: what a site admin checks before a large job queues. Keys are files named on these
    lines, never their content; of the environment only what rlhpc sets or removes is shown."""
    from rlhpc.engine_server.sglang import SGLangSpec
    from rlhpc.rollout.reward_model import reward_rollout_config
    from rlhpc.rollout.teacher import teacher_rollout_config
    from rlhpc.wire.lora import LoraServing

    c, r = cfg.cluster, cfg.rollout
    nnodes = max(1, c.rollout_gpus_per_engine // (c.rollout_gpus_per_node or c.gpus_per_node))
    rollout = SGLangSpec(
        c.rollout_gpus_per_engine, r.sglang.mem_fraction_static, c.colocate or c.offload, cfg.seed,
        extra_args=tuple(r.sglang.extra_args), nnodes=nnodes, deterministic=cfg.deterministic, colocated=c.colocate,
        routed_experts=cfg.algo.routing_replay, lora=LoraServing.for_run(cfg.actor.lora),
    )  # fmt: skip
    model = cfg.model.path or "<run dir>/base_model"
    if r.quantization == "fp8":  # the engines start from the copy the first start writes (rlhpc.driver)
        model = str(run.fp8_model)
    out = [
        _group("engine", r.backend, rollout, model, run, fp8=r.quantization == "fp8", routed=cfg.algo.routing_replay)
    ]
    rm = cfg.reward_model
    if rm is not None:
        sg = reward_rollout_config(r, rm).sglang
        spec = SGLangSpec(rm.gpus_per_engine, sg.mem_fraction_static, False, cfg.seed, extra_args=tuple(sg.extra_args),
                          deterministic=cfg.deterministic)  # fmt: skip
        out.append(_group("reward engine", rm.backend, spec, rm.path or "<run dir>/reward_model", run))
    t = cfg.teacher
    if t is not None:
        sg = teacher_rollout_config(r, t).sglang
        spec = SGLangSpec(t.gpus_per_engine, sg.mem_fraction_static, False, cfg.seed, extra_args=tuple(sg.extra_args),
                          deterministic=cfg.deterministic)  # fmt: skip
        out.append(_group("teacher engine", t.backend, spec, t.path or "<run dir>/teacher", run))
    if r.sglang.router:  # as EngineSet.start decides: CPU engines too
        out.append(_router(run))
    return "".join(out)


def _line(cmd: list[str]) -> str:
    return shlex.join(cmd).replace("'", "")  # the <...> placeholders unquoted


def _group(name: str, backend: str, spec: Any, model: str, run: RunDir, fp8: bool = False, routed: bool = False) -> str:
    """One group's engine 0: an SGLang server (``spec``) or the CPU engine server. ``fp8``: it
    serves ``model``, the block-FP8 copy, which the dry run has not written yet."""
    from rlhpc.engine_server.cpu.command import THREAD_DEFAULTS, server_command
    from rlhpc.engine_server.sglang import engine_env, env_changes, launch_server_command, server_env
    from rlhpc.wire.protocol import FP8_QUANTIZATION, QUANTIZATION_FLAG

    if backend == "sglang":
        cmd = launch_server_command(
            "python", model, NODE_IP, 0, 0, spec, f"<node rank 0 ip>:{FREE_PORT}" if spec.nnodes > 1 else None,
            Path(f"{ENGINE_TMP}/sglang_key.yaml"),
        )  # fmt: skip
        if fp8 and QUANTIZATION_FLAG not in cmd:  # what launch_server_command reads from the copy's config.json
            at = cmd.index("--base-gpu-id") + 2
            cmd[at:at] = [QUANTIZATION_FLAG, FP8_QUANTIZATION]
        for flag in ("--port", "--nccl-port"):
            cmd[cmd.index(flag) + 1] = FREE_PORT
        env = server_env(os.environ, spec, [ENGINE_GPUS])
    else:
        cmd = server_command(
            "python", model, NODE_IP, f"{ENGINE_TMP}/ready.json", "<its Ray actor pid>", THREAD_DEFAULTS["OMP_NUM_THREADS"],
            str(run.engine_key), spec.deterministic, spec.lora, routed,
        )  # fmt: skip
        env = engine_env({**THREAD_DEFAULTS, **os.environ})
    changes = " ".join(env_changes(os.environ, env))
    return f"\n\n{name} 0's launch line (each {name}'s alike):\n  {_line(cmd)}\n  {ENV_NOTE}:\n    {changes}"


def _router(run: RunDir) -> str:
    from rlhpc.engine_server.sglang import router_command

    cmd = router_command("python", ["<engine 0 url>", "..."], "127.0.0.1", 0, 0, run.engine_key, "<driver pid>")
    cmd[cmd.index("--port") + 1] = cmd[cmd.index("--prometheus-port") + 1] = FREE_PORT
    return f"\n\nthe router's launch line (on the driver's node):\n  {_line(cmd)}\n  {ENV_NOTE}: none"
