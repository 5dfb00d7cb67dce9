"""The train loop: generate with the engines, train the actor, push the new weights, repeat.

It runs on the first node of the job, once Ray is up, and talks only to the two groups,
the checkpoint manager and the metrics logger.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rlhpc.actor.group import ActorGroup
from rlhpc.checkpoint import CheckpointManager
from rlhpc.cluster.layout import describe_layout, plan_layout
from rlhpc.cluster.placement import create_placement
from rlhpc.config import Config, config_to_dict
from rlhpc.launch.preemption import Stopped, StopRequest, read_history
from rlhpc.metrics import MetricsLogger
from rlhpc.rollout.group import GenerationAborted, RolloutGroup
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
    actor = ActorGroup(cfg, model_path, placement, layout.actor_slots)
    rollout = RolloutGroup(cfg, model_path, placement, layout, run.logs / "engines")
    rollout.progress, rollout.stop = progress, stop
    checkpoints = CheckpointManager(run.checkpoints, cfg.checkpoint.keep_last)
    buffer = rollout.data_buffer

    num_rollout = cfg.rollout.num_rollout or buffer.num_rollout_per_epoch * cfg.rollout.num_epoch

    # Resume: everything comes from the newest valid checkpoint on disk, nothing from the submission.
    resume = checkpoints.latest() if cfg.checkpoint.resume == "auto" else None
    if resume is not None:
        buffer.check_resume(resume.state["data"])
        log.info("resuming from %s: next rollout %d of %d", resume.path.name, resume.next_rollout_id, num_rollout)
    start = resume.next_rollout_id if resume else 0
    actor.load(str(resume.path) if resume else None)
    metrics = MetricsLogger(
        run.path, cfg.logging, config_to_dict(cfg), num_rollout, resume.state.get("wandb_id") if resume else None
    )
    metrics.rewind(start)
    if resume is not None:
        metrics.restore(resume.rollout_id, resume.state["metrics"])

    rollout.connect_weights(actor)  # also how a restarted engine gets the current weights back
    if cfg.cluster.offload:
        rollout.onload()
    rollout.sync_weights(version=start)  # engines always start from the trained weights

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
            "restarts": read_history(run.path),
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

    bar = progress.add_task("training", total=num_rollout, completed=start) if progress else None
    try:
        for rollout_id in range(start, num_rollout):
            stop_if_requested(rollout_id)
            if cfg.eval.interval is not None and rollout_id == 0:
                metrics.log("eval", -1, rollout.evaluate(-1))  # the untrained baseline

            timer = Timer()
            with timer("step"):
                with timer("generate"):
                    try:
                        batch, rollout_metrics, texts = rollout.generate(rollout_id)
                    except GenerationAborted:
                        stop_if_requested(rollout_id)
                        raise
                if cfg.cluster.offload:
                    rollout.offload()
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
                    rollout.onload()
                with timer("update_weights"):
                    rollout.sync_weights(version=rollout_id + 1)
            record = {**rollout_metrics, **train_metrics, **timer}
            metrics.log("rollout", rollout_id, record)
            metrics.dump_rollout(rollout_id, batch, texts)
            if every(cfg.eval.interval, rollout_id, epoch_end) or (last and cfg.eval.interval is not None):
                metrics.log("eval", rollout_id, rollout.evaluate(rollout_id))
            if bar is not None:
                progress.advance(bar)
    finally:
        metrics.close()

    rollout.shutdown()
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
