"""The dry run: the sbatch script, the GPU plan, the memory estimate and the engines' launch
lines, without submitting or writing anything."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from rlhpc.cluster import memory
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
    engine = (
        f"\n\nengine 0's launch line (each engine's alike):\n  {engine_preview(cfg)}"
        if cfg.rollout.backend == "sglang"
        else ""
    )
    rm = cfg.reward_model
    if rm is not None and rm.backend == "sglang":
        engine += f"\n\nreward engine 0's launch line (each reward engine's alike):\n  {reward_engine_preview(cfg)}"
    if cfg.teacher is not None and cfg.teacher.backend == "sglang":
        engine += f"\n\nteacher engine 0's launch line (each teacher engine's alike):\n  {teacher_engine_preview(cfg)}"
    return (
        f"{script}\n\n{layout}\n  full map: {where} (written at submission){notes}\n\n{memory.summarize(cfg)}{engine}\n\n"
        f"# the resolved config the job runs (written to {RunDir(run_dir).path / 'config.yaml'}):\n{dump_config(cfg)}"
    )


def reward_engine_preview(cfg: Config) -> str:
    """The SGLang server command of reward engine 0 (a classifier's with ``--is-embedding``: it serves /classify)."""
    from rlhpc.engine_server.sglang import SGLangSpec
    from rlhpc.rollout.reward_model import reward_rollout_config

    rm = cfg.reward_model
    sg = reward_rollout_config(cfg.rollout, rm).sglang
    spec = SGLangSpec(rm.gpus_per_engine, sg.mem_fraction_static, False, cfg.seed, extra_args=tuple(sg.extra_args))
    return _preview(spec, rm.path or "<run dir>/reward_model")


def teacher_engine_preview(cfg: Config) -> str:
    """The SGLang server command of teacher engine 0."""
    from rlhpc.engine_server.sglang import SGLangSpec
    from rlhpc.rollout.teacher import teacher_rollout_config

    t = cfg.teacher
    sg = teacher_rollout_config(cfg.rollout, t).sglang
    spec = SGLangSpec(t.gpus_per_engine, sg.mem_fraction_static, False, cfg.seed, extra_args=tuple(sg.extra_args))
    return _preview(spec, t.path or "<run dir>/teacher")


def engine_preview(cfg: Config) -> str:
    """The SGLang server command of engine 0, with what is known only on the node as <...>."""
    from rlhpc.engine_server.sglang import SGLangSpec

    c, sg = cfg.cluster, cfg.rollout.sglang
    tp = c.rollout_gpus_per_engine
    nnodes = max(1, tp // (c.rollout_gpus_per_node or c.gpus_per_node))
    spec = SGLangSpec(
        tp, sg.mem_fraction_static, c.colocate or c.offload, cfg.seed, extra_args=tuple(sg.extra_args), nnodes=nnodes
    )
    return _preview(spec, cfg.model.path or "<run dir>/base_model")


def _preview(spec: Any, model: str) -> str:
    """``spec``'s launch line (an ``SGLangSpec``), with what is known only on the node as <...>."""
    from rlhpc.engine_server.sglang import launch_server_command

    nnodes = spec.nnodes
    cmd = launch_server_command(
        "python", model, "<node ip>", 0, 0, spec, "<node rank 0 ip>:<port>" if nnodes > 1 else None,
        Path("<engine tmp dir>/sglang_key.yaml"),
    )  # fmt: skip
    for flag in ("--port", "--nccl-port"):
        cmd[cmd.index(flag) + 1] = "<free port>"
    return shlex.join(cmd).replace("'", "")
