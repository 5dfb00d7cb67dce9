"""Evaluate a saved checkpoint of a run on its eval sets, with the code the run evaluates with.

rlhpc-eval runs/exp1                                  # the newest checkpoint
rlhpc-eval runs/exp1 --checkpoint rollout_19          # a given one
rlhpc-eval runs/exp1 --set eval.sets.hard.file=hard.jsonl --set data.reward=rlhpc.rewards:math

The run's own config.yaml (with the --set values on top) says the eval sets, the reward and the
engines; a set added with --set eval.sets.NAME... to a run that had none of its own is evaluated
beside the run's own eval rows (data.eval_file, or the task's), which keep their name (eval/reward); the engines start from the checkpoint's model (the actor's HF directory) in a local Ray,
as the embedded default's do. The metrics are printed and written to RUN_DIR/evals/rollout_N.json.
Without RUN_DIR it reads $RLHPC_RUN_DIR, so it runs as a follow-up: jobs/submit.py --then rlhpc-eval.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from rlhpc import config
from rlhpc.actor.checkpoint_dir import ACTOR_SUBDIR, ADAPTER_CONFIG
from rlhpc.checkpoint import PREFIX, STATE, CheckpointManager, checkpoint_name, validate
from rlhpc.config import DEFAULT_EVAL_SET, Config
from rlhpc.errors import RlhpcError
from rlhpc.launch.followup import RUN_DIR_ENV
from rlhpc.logs import setup_logging
from rlhpc.preflight import config_from_dict
from rlhpc.run_dir import RunDir
from rlhpc.util.files import apply_access, write_atomic
from rlhpc.util.processes import safe_python_env

log = logging.getLogger(__name__)


def find_checkpoint(run: RunDir, name: str | None) -> tuple[Path, int]:
    """(directory, rollout id) of checkpoint ``name`` (``rollout_N``; None: the newest valid one)."""
    if not run.config_file.is_file():
        raise RlhpcError(
            f"{run.path} is not a run dir (it has no config.yaml)",
            "pass the --run-dir of a submitted run, e.g. rlhpc-eval runs/exp1",
        )
    if name is None:
        latest = CheckpointManager(run.checkpoints, keep_last=1).latest() if run.checkpoints.is_dir() else None
        if latest is None:
            raise RlhpcError(
                f"run {run.path} has no complete checkpoint yet",
                "wait for the run's first save (checkpoint.save_interval), or evaluate another run",
            )
        return latest.path, latest.rollout_id
    digits = name.removeprefix(PREFIX)
    if not digits.isdigit():
        raise RlhpcError(f"--checkpoint {name!r} is not rollout_N", "name a checkpoint as rollout_N, e.g. rollout_19")
    path = run.checkpoints / checkpoint_name(int(digits))
    problem = validate(path) if path.is_dir() else f"{path} does not exist"
    if problem is not None:
        have = (
            sorted(p.name for p in run.checkpoints.glob(f"{PREFIX}*") if p.is_dir()) if run.checkpoints.is_dir() else []
        )
        raise RlhpcError(
            f"checkpoint {name} of {run.path} cannot be evaluated: {problem}",
            f"pick one of: {', '.join(have)}" if have else "wait for the run's first checkpoint",
        )
    return path, json.loads((path / STATE).read_text())["rollout_id"]


def eval_config(run: RunDir, overrides: list[str]) -> Config:
    """The run's config with ``overrides`` on top. Sets added to a run without named sets of its
    own go beside its default set (``data.eval_file``, or the task's eval rows), which becomes the
    set ``default`` (logged under the same names as in the run): with ``eval.sets`` alone only the
    named sets would run, and ``data.eval_file`` beside them is refused."""
    tree = config.load_tree(run.config_file)
    had_sets = bool((tree.get("eval") or {}).get("sets"))
    tree = config.load_tree(run.config_file, overrides)
    sets = (tree.get("eval") or {}).get("sets") or {}
    if sets and not had_sets and DEFAULT_EVAL_SET not in sets:
        data = tree.setdefault("data", {})
        tree["eval"]["sets"] = {DEFAULT_EVAL_SET: {"file": data.pop("eval_file", None)}, **sets}
    return config_from_dict(tree)


def model_dir(ckpt: Path) -> Path:
    """The checkpoint's model as an HF directory the engines load."""
    actor = ckpt / ACTOR_SUBDIR
    if not (actor / "config.json").is_file():
        raise RlhpcError(
            f"{actor} holds no HF model (a megatron checkpoint keeps its weights sharded under dist/)",
            "convert it with tools/convert_checkpoint.py and evaluate the HF directory it writes",
        )
    if (actor / ADAPTER_CONFIG).is_file():
        raise RlhpcError(
            f"{actor} holds a LoRA adapter, not a whole model (a run with actor.lora)",
            f"merge it first: python tools/convert_checkpoint.py merge-lora {ckpt} OUT, and evaluate OUT",
        )
    return actor


def evaluate_checkpoint(cfg: Config, run: RunDir, ckpt: Path, rollout_id: int) -> dict[str, float]:
    """The eval record of ``ckpt`` (``rlhpc.driver.evaluate_sets``), on engines started from its model."""
    from rlhpc.cluster.layout import plan_layout
    from rlhpc.launch.local_ray import local_ray
    from rlhpc.runtime.signals import StopRequest

    layout = plan_layout(cfg.cluster, cfg.reward_model, cfg.teacher)  # the run's: its engines, its reward model's
    with local_ray(cfg.cluster, layout.num_slots, StopRequest()):
        from rlhpc.cluster.placement import create_placement
        from rlhpc.data.buffer import load_eval_sets
        from rlhpc.data.images import load_vision
        from rlhpc.driver import evaluate_sets, prompt_prep
        from rlhpc.model import context_length, load_tokenizer
        from rlhpc.rollout.build import Frozen, build_generation
        from rlhpc.rollout.engines import EnginePool
        from rlhpc.rollout.reward_model import start_reward_engines

        weights = str(model_dir(ckpt))
        tokenizer = load_tokenizer(run.model_path(cfg))  # the run's, as its driver encodes prompts with
        sets = cfg.eval.resolved_sets(cfg.data, cfg.rollout)
        vision = load_vision(run.model_path(cfg))
        rows = load_eval_sets(cfg.data, sets, prompt_prep(cfg, tokenizer, context_length(weights), vision))
        placement = create_placement(layout.num_slots, layout.slot_groups if layout.heterogeneous else None)
        pools = []
        try:
            logs = Path(tempfile.mkdtemp(prefix="rlhpc-eval-logs-"))
            engines = EnginePool.start(
                cfg.rollout, cfg.cluster, cfg.seed, weights, placement, layout, logs, deterministic=cfg.deterministic
            )
            pools.append(engines)
            reward_model = None
            if cfg.reward_model is not None:  # the run's reward model or judge scores as it did in the run
                rm_path = run.reward_model_path(cfg)
                rm_engines = start_reward_engines(
                    cfg.reward_model, cfg.rollout, cfg.cluster, cfg.seed, rm_path, placement, layout, logs / "reward",
                    deterministic=cfg.deterministic,
                )  # fmt: skip
                pools.append(rm_engines)
                reward_model = Frozen(rm_engines, rm_path)
            generation = build_generation(
                cfg, tokenizer, engines.generate, len(layout.engine_slots), reward_model=reward_model
            )
            return evaluate_sets(generation, rollout_id, sets, rows)
        finally:
            for pool in reversed(pools):
                pool.shutdown()
            placement.remove()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", nargs="?", default=os.environ.get(RUN_DIR_ENV), help=f"default: ${RUN_DIR_ENV}")
    p.add_argument("--checkpoint", help="rollout_N (default: the newest complete checkpoint)")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="override the run's config, KEY=VALUE")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        if args.run_dir is None:
            raise RlhpcError(f"no run dir given and ${RUN_DIR_ENV} is not set", "run: rlhpc-eval RUN_DIR")
        run = RunDir(args.run_dir)
        ckpt, rollout_id = find_checkpoint(run, args.checkpoint)
        model_dir(ckpt)  # refused before Ray starts
        cfg = eval_config(run, args.overrides)
        # The rules of a job (issue 43, item 12): what it writes as private as the run dir, no
        # Python of it importing from the working dir; its local Ray requires a token of its own.
        apply_access(run.path, cfg.run_dir_access)
        safe_python_env()
        values = evaluate_checkpoint(cfg, run, ckpt, rollout_id)
    except RlhpcError as e:
        log.error("%s", e)
        return 2
    except KeyboardInterrupt:
        log.warning("interrupted; nothing was written")
        return 130
    out = run.path / "evals" / f"{ckpt.name}.json"
    out.parent.mkdir(exist_ok=True)
    record = {"checkpoint": ckpt.name, "rollout_id": rollout_id, "overrides": args.overrides, "metrics": values}
    write_atomic(out, json.dumps(record, indent=1) + "\n")
    print(f"{ckpt.name}: the weights after rollout {rollout_id}", file=sys.stderr)  # as the run's log names it
    for key, value in values.items():
        print(f"{key:<24} {value:.4f}")
    print(f"written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
