"""The train loop: generate with the engines, train the actor, push the new weights, repeat.

It runs on the first node of the job, once Ray is up. It owns the data buffer (which rows each
rollout gets, resume, epoch ends) and composes the actor group, the engine pool, the generation
step (rows -> scored samples, through the pool), the checkpoint manager and the metrics logger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rlhpc.actor.group import ActorGroup, ActorSpec
from rlhpc.checkpoint import CheckpointManager
from rlhpc.cluster.layout import plan_layout, summarize_layout
from rlhpc.cluster.placement import create_placement
from rlhpc.config import Config, config_to_dict
from rlhpc.launch.restarts import read_history
from rlhpc.launch.signals import Stopped, StopRequest
from rlhpc.launch.staging import NOT_STAGED, Staged
from rlhpc.launch.startup import StartupClock
from rlhpc.metrics import MetricsLogger, read_metrics
from rlhpc.model import load_tokenizer
from rlhpc.rollout.buffer import load_data
from rlhpc.rollout.engine_pool import EnginePool
from rlhpc.rollout.generation import Generation, GenerationAborted, task_reward
from rlhpc.run_dir import RunDir
from rlhpc.schedule import AsyncRollouts, BusyClock, Generated, SyncRollouts

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


PENDING_FILE = "pending_rollouts.pt"  # generated, not yet trained rollouts (async pipeline)


def save_pending(staging: Path, pending: dict[int, Generated]) -> None:
    if pending:
        torch.save([g.state_dict() for g in pending.values()], staging / PENDING_FILE)


def load_pending(ckpt: Path) -> dict[int, Generated]:
    path = ckpt / PENDING_FILE
    if not path.is_file():
        return {}
    return {d["rollout_id"]: Generated.from_state_dict(d) for d in torch.load(path, weights_only=True)}


class _AbortWhen:
    """The engine pool's stop request, decided by the schedule (what a stop may drop)."""

    def __init__(self, requested: Callable[[], bool]):
        self._requested = requested

    @property
    def requested(self) -> bool:
        return self._requested()


def train(
    cfg: Config,
    run: RunDir,
    progress: Progress | None = None,
    stop: StopRequest | None = None,
    startup: StartupClock | None = None,
    staged: Staged = NOT_STAGED,
) -> dict:
    """``startup``: the job's start-up clock (``rlhpc.launch.job`` starts it before Ray); None: from now.
    ``staged``: this node's copies of the model and the checkpoint to resume from (cluster.stage_dir)."""
    startup = startup if startup is not None else StartupClock(run)
    layout = plan_layout(cfg.cluster)
    log.info(
        "%s\n  full map: %s",
        summarize_layout(layout),
        run.layout_file,
    )
    with startup.phase("placement"):
        placement = create_placement(layout.num_slots, layout.slot_groups if layout.heterogeneous else None)
    model_path = staged.get(run.model_path(cfg))
    buffer, eval_rows = load_data(cfg.data, cfg.rollout.rollout_batch_size, cfg.seed)
    num_rollout = cfg.rollout.num_rollout or buffer.num_rollout_per_epoch * cfg.rollout.num_epoch

    def generate(rollout_id: int) -> Generated:
        start_s = time.perf_counter()
        # Async: this runs beside training, so a dead engine is restarted by the main thread, between rollouts.
        with engines.restarts_deferred() if staleness > 0 else nullcontext():
            batch, rollout_metrics, texts = generation.rollout(
                rollout_id, buffer.batch(rollout_id), lambda k, count: buffer.extra_rows(rollout_id, k, count)
            )
        # engines serving at the end of the rollout: fewer after a node loss, back after it rejoined
        extra = {"rollout/num_engines": engines.num_engines, "time/generate": time.perf_counter() - start_s}
        return Generated(rollout_id, batch, {**rollout_metrics, **extra}, texts)

    def push(version: int) -> None:
        engines.sync_weights(version=version)

    # When each rollout is generated (rlhpc/schedule.py): inline, or ahead of training in a thread.
    clock = BusyClock()
    staleness = cfg.rollout.max_staleness
    if staleness == 0:
        schedule: SyncRollouts | AsyncRollouts = SyncRollouts(generate, push, clock)
        pool_stop = stop
    else:
        requested = (lambda: stop.requested) if stop is not None else (lambda: False)
        schedule = AsyncRollouts(
            generate, push, clock, staleness, num_rollout, cfg.deterministic, requested,
            repair=lambda: engines.ensure_engines(), partial=cfg.rollout.partial_rollout,
        )  # fmt: skip
        pool_stop = _AbortWhen(schedule.abort_requested)

    def start_engines() -> EnginePool:
        return EnginePool(
            cfg.rollout, cfg.cluster, cfg.seed, model_path, placement, layout, run.engine_logs, pool_stop,
            run.engine_key,
        )  # fmt: skip

    # The engines start in a thread while the actor ranks start and load here: neither needs the
    # other until the weight channel opens. Not when they share GPUs: an engine sizes its memory
    # by what the actor left free.
    engines_up = None if layout.colocate else startup.background("engines_up", start_engines)
    with startup.phase("actor_up"):
        actor = ActorGroup(
            ActorSpec.from_config(cfg), model_path, placement, layout.actor_slots, cfg.cluster.colocate, stop
        )
    checkpoints = CheckpointManager(run.checkpoints, cfg.checkpoint.keep_last)
    checkpoints.clean_debris()  # staging left by a killed save
    if cfg.checkpoint.resume == "never":
        checkpoints.start_fresh()  # older checkpoints go to checkpoints/superseded-*/: never resumed from or deleted

    # Resume: everything comes from the newest valid checkpoint on disk, nothing from the submission.
    resume = checkpoints.latest() if cfg.checkpoint.resume == "auto" else None
    if resume is not None:
        buffer.check_resume(resume.state["data"])
        log.info("resuming from %s: next rollout %d of %d", resume.path.name, resume.next_rollout_id, num_rollout)
    start = resume.next_rollout_id if resume else 0
    with startup.phase("actor_load"):
        actor.load(staged.get(resume.path) if resume else None)  # the staged copy, if this one was staged
    pending = load_pending(resume.path) if resume else {}  # generated before the stop with weights now gone
    metrics = MetricsLogger(
        run, cfg.logging, config_to_dict(cfg), num_rollout, resume.state.get("wandb_id") if resume else None
    )
    metrics.rewind(start)
    if resume is not None:
        metrics.restore(resume.rollout_id, resume.state["metrics"])

    if engines_up is None:
        with startup.phase("engines_up"):
            engines = start_engines()
    else:
        engines = engines_up.result()
    generation = Generation(
        load_tokenizer(model_path), task_reward(cfg.data), cfg.rollout, cfg.eval, cfg.algo, cfg.seed,
        send=engines.generate, progress=progress,
    )  # fmt: skip
    with startup.phase("weight_channel"):
        engines.connect_weights(actor)  # the actor is the engines' one weight source, restarted engines included
    with startup.phase("first_push"):
        if cfg.cluster.offload:
            engines.onload()
        engines.sync_weights(version=start)  # engines always start from the trained weights

    saved = resume.rollout_id if resume else -1  # newest rollout whose training is on disk
    record: dict = {}  # metrics of the newest trained rollout

    def save(rollout_id: int) -> None:
        nonlocal saved
        generated = schedule.pending(rollout_id)  # deterministic async: waits for what needs older weights
        state = {
            "data": buffer.state_dict(rollout_id + 1),
            "weight_version": rollout_id + 1,
            "pending_rollouts": sorted(generated),
            "wandb_id": metrics.wandb_id,
            "metrics": record,  # restored if the job dies before the record reaches metrics.jsonl
            "restarts": read_history(run),
        }

        def snapshot(staging: Path) -> Callable[[], dict]:
            actor.snapshot(str(staging))  # the ranks' state in host memory: all the loop waits for
            save_pending(staging, generated)
            return actor.write_snapshot  # the ranks write it on their checkpoint threads

        # A failed save leaves nothing half-written; a background one raises at the next wait.
        checkpoints.save_async(rollout_id, snapshot, state, background=cfg.checkpoint.async_save)
        if not cfg.checkpoint.async_save:
            checkpoints.wait()
        saved = rollout_id

    def stop_if_requested(next_rollout_id: int) -> None:
        """A safe point: on a stop request, make sure the newest training is saved, then stop."""
        if stop is None or not stop.requested:
            return
        if next_rollout_id - 1 > saved:
            log.warning("%s: saving rollout %d before stopping", stop.name, next_rollout_id - 1)
            save(next_rollout_id - 1)
        checkpoints.wait()  # the save in flight commits before the job requeues
        raise Stopped(next_rollout_id, stop.name)

    def get(rollout_id: int) -> Generated:
        try:
            return schedule.get(rollout_id)
        except GenerationAborted:  # cut short by a stop request: save what is trained, then stop
            stop_if_requested(rollout_id)
            raise

    def evaluate(rollout_id: int) -> None:
        try:
            with schedule.exclusive():  # between two rollouts: the engines hold the newest weights
                values = generation.evaluate(rollout_id, eval_rows)
        except GenerationAborted:
            log.warning("evaluation after rollout %d cut short by a stop request; it runs again at resume", rollout_id)
            stop_if_requested(rollout_id + 1)
            raise
        metrics.log("eval", rollout_id, values)

    def eval_due(rollout_id: int) -> bool:
        last = rollout_id == num_rollout - 1
        return every(cfg.eval.interval, rollout_id, buffer.is_epoch_end(rollout_id)) or (
            last and cfg.eval.interval is not None
        )

    bar = progress.add_task("training", total=num_rollout, completed=start) if progress else None
    try:
        # once: a job killed before its first checkpoint logged it already (rewind keeps it)
        baseline_logged = any(m["kind"] == "eval" and m["rollout_id"] == -1 for m in read_metrics(run))
        if cfg.eval.interval is not None and start == 0 and not baseline_logged:
            stop_if_requested(0)
            with startup.phase("first_eval"):
                evaluate(-1)  # the untrained baseline
        if resume is not None and eval_due(resume.rollout_id):
            # A stop (or a kill) between the checkpoint and its evaluation: the engines hold the
            # same weights again, so the evaluation is run now, once.
            if not any(m["kind"] == "eval" and m["rollout_id"] == resume.rollout_id for m in read_metrics(run)):
                stop_if_requested(start)
                with startup.phase("first_eval"):
                    evaluate(resume.rollout_id)
        loop_began = time.monotonic()
        schedule.start(start, pending)
        for rollout_id in range(start, num_rollout):
            stop_if_requested(rollout_id)

            timer = Timer()
            step_start = time.perf_counter()
            with timer("step"):
                with timer("generate" if staleness == 0 else "wait_rollout"):
                    generated = get(rollout_id)
                batch, texts = generated.batch, generated.texts
                rollout_metrics = {k: v for k, v in generated.metrics.items() if k != "time/generate"}
                if staleness > 0:
                    timer["time/generate"] = generated.metrics["time/generate"]
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
                    schedule.push(rollout_id + 1)
            if (write_s := checkpoints.collect()) is not None:  # a save's background write + commit
                timer["time/save_write"] = write_s
            step = timer["time/step"]
            timer["time/actor_idle"] = max(0.0, 1.0 - (timer["time/train"] + timer.get("time/save", 0.0)) / step)
            timer["time/rollout_idle"] = clock.idle_fraction(step_start, step_start + step)
            record = {**rollout_metrics, **train_metrics, **timer}
            metrics.log("rollout", rollout_id, record)
            startup.first_rollout_done(loop_began)  # once per start
            metrics.dump_rollout(rollout_id, batch, texts)
            if eval_due(rollout_id):
                evaluate(rollout_id)
            if bar is not None:
                progress.advance(bar)
        checkpoints.wait()  # the last checkpoint is committed before the run counts as finished
    finally:
        if checkpoints.in_flight is not None:  # leaving on an error: the save in flight still commits if it can
            try:
                checkpoints.wait()
            except Exception as e:
                log.warning("the checkpoint save in flight failed too: %s", e)
        schedule.close()
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
