"""The train loop: generate with the engines, train the actor, push the new weights, repeat.

It runs on the first node of the job, once Ray is up. It owns the data buffer (which rows each
rollout gets, resume, epoch ends) and composes the actor group, the engine pool, the generation
step (rows -> scored samples, through the pool), the checkpoint manager and the metrics logger.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rlhpc.actor.group import ActorGroup, ActorSpec
from rlhpc.batch import RolloutBatch
from rlhpc.checkpoint import CheckpointManager
from rlhpc.cluster.layout import describe_layout, plan_layout
from rlhpc.cluster.placement import create_placement
from rlhpc.config import Config, config_to_dict
from rlhpc.launch.restarts import read_history
from rlhpc.launch.signals import Stopped, StopRequest
from rlhpc.metrics import MetricsLogger
from rlhpc.model import load_tokenizer
from rlhpc.rollout.buffer import load_data
from rlhpc.rollout.engine_pool import EnginePool
from rlhpc.rollout.generation import Generation, GenerationAborted, task_reward
from rlhpc.run_dir import RunDir

log = logging.getLogger(__name__)


class Timer(dict):
    """``with timer("generate"): ...`` records seconds under ``time/generate``."""

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self[f"time/{name}"] = time.perf_counter() - start


def every(interval: int | None, rollout_id: int, epoch_end: bool) -> bool:
    return interval is not None and ((rollout_id + 1) % interval == 0 or epoch_end)


def train(cfg: Config, run: RunDir, progress: Progress | None = None, stop: StopRequest | None = None) -> dict:
    layout = plan_layout(cfg.cluster)
    log.info(describe_layout(layout, cfg.cluster.gpus_per_node))
    placement = create_placement(layout.num_slots)
    model_path = run.model_path(cfg)
    buffer, eval_rows = load_data(cfg.data, cfg.rollout.rollout_batch_size, cfg.seed)
    actor = ActorGroup(ActorSpec.from_config(cfg), model_path, placement, layout.actor_slots, cfg.cluster.colocate)
    engines = EnginePool(
        cfg.rollout, cfg.cluster, cfg.seed, model_path, placement, layout, run.engine_logs, stop, run.engine_key
    )
    generation = Generation(
        load_tokenizer(model_path), task_reward(cfg.data), cfg.rollout, cfg.eval, cfg.algo, cfg.seed,
        send=engines.generate, progress=progress,
    )  # fmt: skip
    checkpoints = CheckpointManager(run.checkpoints, cfg.checkpoint.keep_last)

    num_rollout = cfg.rollout.num_rollout or buffer.num_rollout_per_epoch * cfg.rollout.num_epoch

    # Resume: everything comes from the newest valid checkpoint on disk, nothing from the submission.
    resume = checkpoints.latest() if cfg.checkpoint.resume == "auto" else None
    if resume is not None:
        buffer.check_resume(resume.state["data"])
        log.info("resuming from %s: next rollout %d of %d", resume.path.name, resume.next_rollout_id, num_rollout)
    start = resume.next_rollout_id if resume else 0
    actor.load(str(resume.path) if resume else None)
    metrics = MetricsLogger(
        run, cfg.logging, config_to_dict(cfg), num_rollout, resume.state.get("wandb_id") if resume else None
    )
    metrics.rewind(start)
    if resume is not None:
        metrics.restore(resume.rollout_id, resume.state["metrics"])

    engines.connect_weights(actor)  # the actor is the engines' one weight source, restarted engines included
    if cfg.cluster.offload:
        engines.onload()
    engines.sync_weights(version=start)  # engines always start from the trained weights

    saved = resume.rollout_id if resume else -1  # newest rollout whose training is on disk
    record: dict = {}  # metrics of the newest trained rollout

    def save(rollout_id: int) -> None:
        nonlocal saved
        staging = checkpoints.stage(rollout_id)
        actor.save(str(staging))
        state = {
            "data": buffer.state_dict(rollout_id + 1),
            "weight_version": rollout_id + 1,
            "wandb_id": metrics.wandb_id,
            "metrics": record,  # restored if the job dies before the record reaches metrics.jsonl
            "restarts": read_history(run),
        }
        checkpoints.commit(staging, rollout_id, state)
        saved = rollout_id

    def stop_if_requested(next_rollout_id: int) -> None:
        """A safe point: on a stop request, make sure the newest training is saved, then stop."""
        if stop is None or not stop.requested:
            return
        if next_rollout_id - 1 > saved:
            log.warning("%s: saving rollout %d before stopping", stop.name, next_rollout_id - 1)
            save(next_rollout_id - 1)
        raise Stopped(next_rollout_id, stop.name)

    def generate(rollout_id: int) -> tuple[RolloutBatch, dict[str, float], dict[str, list[str]]]:
        try:
            return generation.rollout(rollout_id, buffer.batch(rollout_id))
        except GenerationAborted:  # cut short by a stop request: save what is trained, then stop
            stop_if_requested(rollout_id)
            raise

    bar = progress.add_task("training", total=num_rollout, completed=start) if progress else None
    try:
        for rollout_id in range(start, num_rollout):
            stop_if_requested(rollout_id)
            if cfg.eval.interval is not None and rollout_id == 0:
                metrics.log("eval", -1, generation.evaluate(-1, eval_rows))  # the untrained baseline

            timer = Timer()
            with timer("step"):
                with timer("generate"):
                    batch, rollout_metrics, texts = generate(rollout_id)
                if cfg.cluster.offload:
                    engines.offload()
                with timer("train"):
                    train_metrics = actor.train(rollout_id, batch)
                record = {**rollout_metrics, **train_metrics, **timer}
                epoch_end = buffer.is_epoch_end(rollout_id)
                last = rollout_id == num_rollout - 1
                if every(cfg.checkpoint.save_interval, rollout_id, epoch_end) or last or (stop and stop.requested):
                    with timer("save"):
                        save(rollout_id)
                if cfg.cluster.offload:
                    actor.offload()
                    engines.onload()
                with timer("update_weights"):
                    engines.sync_weights(version=rollout_id + 1)
            record = {**rollout_metrics, **train_metrics, **timer}
            metrics.log("rollout", rollout_id, record)
            metrics.dump_rollout(rollout_id, batch, texts)
            if every(cfg.eval.interval, rollout_id, epoch_end) or (last and cfg.eval.interval is not None):
                metrics.log("eval", rollout_id, generation.evaluate(rollout_id, eval_rows))
            if bar is not None:
                progress.advance(bar)
    finally:
        metrics.close()

    engines.shutdown()
    actor.shutdown()
    placement.remove()
    return {"num_rollout": num_rollout, "resumed_from": resume.rollout_id if resume else None}


def make_progress(console=None) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
