"""The train loop: generate with the engines, train the actor, push the new weights, repeat.

It runs on the first node of the job, once Ray is up. It owns the data buffer (which rows each
rollout gets, resume, epoch ends) and composes the actor group, the engine pool, the generation
step (rows -> scored samples, through the pool), the checkpoint manager and the metrics logger.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rlhpc import sandbox
from rlhpc.actor.group import ActorGroup, ActorSpec
from rlhpc.algo.grpo import kl_in_reward
from rlhpc.checkpoint import CheckpointManager
from rlhpc.cluster.layout import plan_layout, summarize_layout
from rlhpc.cluster.placement import create_placement
from rlhpc.config import DEFAULT_EVAL_SET, Config, EvalSetConfig, config_to_dict, eval_split
from rlhpc.data.buffer import load_eval_sets, load_train
from rlhpc.data.images import Vision, load_vision
from rlhpc.data.prompts import PromptPrep, prepare_prompts
from rlhpc.data.tasks import TASKS
from rlhpc.metric_names import eval_name
from rlhpc.metrics import MetricsLogger, read_metrics
from rlhpc.model import context_length, load_tokenizer
from rlhpc.rollout.build import Frozen, build_generation
from rlhpc.rollout.engines import EnginePool
from rlhpc.rollout.engines.fleet import adapter_name
from rlhpc.rollout.generation import Generation
from rlhpc.rollout.journal import ToolJournal
from rlhpc.rollout.reward_model import start_reward_engines
from rlhpc.rollout.scoring import MixedScorer
from rlhpc.rollout.teacher import start_teacher_engines
from rlhpc.rollout.weight_sync import WeightSync
from rlhpc.run_dir import RunDir
from rlhpc.runtime.restarts import read_history
from rlhpc.runtime.signals import Stopped, StopRequest
from rlhpc.runtime.staging import NOT_STAGED, Staged
from rlhpc.runtime.startup import StartupClock
from rlhpc.schedule import AbortWhen, AsyncRollouts, BusyClock, Generated, SyncRollouts, load_pending, save_pending
from rlhpc.weights.fp8 import is_fp8_checkpoint
from rlhpc.weights.fp8 import write_checkpoint as write_fp8_checkpoint
from rlhpc.wire.lora import POLICY_ADAPTER, LoraServing
from rlhpc.wire.request import GenerationAborted

log = logging.getLogger(__name__)


class Timer(dict):
    """``with timer("generate"): ...`` adds its seconds to ``time/generate``."""

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self[f"time/{name}"] = self.get(f"time/{name}", 0.0) + time.perf_counter() - start


def prompt_prep(cfg: Config, tokenizer: Any, context: int | None, vision: Vision | None = None) -> PromptPrep:
    """Chat rows rendered, and each split's prompts held to ``data.max_prompt_tokens`` or what the
    context leaves after the split's ``max_new_tokens`` (no limit when neither is known). The
    splits: ``train`` and each eval set's (``eval_split``). ``vision``: a vision-language model's
    image processor (rows with images are rendered with their image tokens)."""
    sets = cfg.eval.resolved_sets(cfg.data, cfg.rollout)
    new = {
        "train": cfg.rollout.max_new_tokens,
        "eval": cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
        **{eval_split(name): s.max_new_tokens for name, s in sets.items()},
    }
    # an episode's prompt leaves room for all its turns
    if cfg.rollout.env or cfg.rollout.tools or TASKS[cfg.data.task].env:
        new = dict.fromkeys(new, cfg.rollout.max_episode_tokens)
    r = cfg.rollout
    multi_turn = bool(r.env or r.tools or r.generate_fn or r.agent or TASKS[cfg.data.task].env)
    limits: dict[str, int] | None = None
    if cfg.data.max_prompt_tokens is not None:
        limits = dict.fromkeys(new, cfg.data.max_prompt_tokens)
    elif context is not None:
        limits = {split: context - n for split, n in new.items()}
    return prepare_prompts(tokenizer, cfg.data, limits, vision, single_turn=not multi_turn)


def evaluate_sets(
    generation: Generation, rollout_id: int, sets: dict[str, EvalSetConfig], rows: dict[str, list[dict]]
) -> dict[str, float]:
    """One eval record: every set's metrics (``Generation.evaluate``) under their names
    (``rlhpc.metric_names.eval_name``: ``eval/reward`` for the default set, ``eval/NAME/mean``)."""
    values = {}
    for name, s in sets.items():
        metrics = generation.evaluate(rollout_id, rows[name], s, seed_tag=eval_split(name))
        named = None if name == DEFAULT_EVAL_SET else name
        values.update({eval_name(named, k): v for k, v in metrics.items()})
    return values


def every(interval: int | None, rollout_id: int, epoch_end: bool) -> bool:
    return interval is not None and ((rollout_id + 1) % interval == 0 or epoch_end)


def train(
    cfg: Config,
    run: RunDir,
    progress: Progress | None = None,
    stop: StopRequest | None = None,
    startup: StartupClock | None = None,
    staged: Staged = NOT_STAGED,
) -> dict:
    """One start of the run: set up and resume, train to the end (or a stop), shut down.

    ``startup``: the job's start-up clock (``rlhpc.launch.job`` starts it before Ray); None: from now.
    ``staged``: this node's copies of the model and the checkpoint to resume from (cluster.stage_dir)."""
    loop = TrainLoop(cfg, run, progress, stop, startup if startup is not None else StartupClock(run), staged)
    try:
        loop.run()
    finally:
        loop.close()
    loop.shutdown()
    return {"num_rollout": loop.num_rollout, "resumed_from": loop.resumed_from}


class TrainLoop:
    """The components of one start, set up and resumed in ``__init__``, and the loop in ``run``:
    each rollout is got from the schedule, trained, saved when due, its weights pushed, logged,
    evaluated when due. Every phase boundary is a safe point for a stop request."""

    def __init__(
        self,
        cfg: Config,
        run: RunDir,
        progress: Progress | None,
        stop: StopRequest | None,
        startup: StartupClock,
        staged: Staged,
    ):
        self.cfg, self.rundir, self.progress, self.stop, self.startup = cfg, run, progress, stop, startup
        layout = plan_layout(cfg.cluster, cfg.reward_model, cfg.teacher)
        log.info("%s\n  full map: %s", summarize_layout(layout), run.layout_file)
        with startup.phase("placement"):
            self.placement = create_placement(layout.num_slots, layout.slot_groups if layout.heterogeneous else None)
        model_path = staged.get(run.model_path(cfg))
        tokenizer = load_tokenizer(model_path)
        self._load_data(tokenizer, context_length(model_path), load_vision(model_path))
        # the engines drop generation in flight when the schedule says so (it is built once they are up)
        pool_stop = AbortWhen(stop)

        lora = cfg.actor.lora  # with push: adapter, the trained engines serve the run's adapter by name
        serving = LoraServing.for_run(lora)
        # on a shared fleet (rollout.fleet) the run's adapter has the run's own name beside the others'
        adapter = adapter_name(run.path) if cfg.rollout.fleet is not None else POLICY_ADAPTER

        engine_model = model_path
        if cfg.rollout.quantization == "fp8":  # the engines start from the model in block FP8
            engine_model = str(run.fp8_model)
            if not is_fp8_checkpoint(engine_model):
                with startup.phase("quantize"):
                    write_fp8_checkpoint(model_path, run.fp8_model)

        def start_engines() -> EnginePool:
            return EnginePool.start(
                cfg.rollout, cfg.cluster, cfg.seed, engine_model, self.placement, layout, run.engine_logs, pool_stop,
                run.engine_key, deterministic=cfg.deterministic, lora=serving,
                routed_experts=cfg.algo.routing_replay, fleet=cfg.rollout.fleet, adapter_name=adapter,
            )  # fmt: skip

        # The engines start in a thread while the actor ranks start and load here: neither needs the
        # other until the weight channel opens. Not when they share GPUs: an engine sizes its memory
        # by what the actor left free. The frozen groups have GPUs of their own in either mode.
        engines_up = None if layout.colocate else startup.background("engines_up", start_engines)
        reward_up, teacher_up = self._start_frozen_groups(layout, pool_stop)
        with startup.phase("actor_up"):
            self.actor = ActorGroup(
                ActorSpec.from_config(cfg, self.num_rollout, str(run.lora_push), adapter),
                model_path,
                self.placement,
                layout.actor_slots,
                cfg.cluster.colocate,
                stop,
            )
        self._resume(staged)

        if engines_up is None:
            with startup.phase("engines_up"):
                self.engines = start_engines()
        else:
            self.engines = engines_up.result()
        self.reward_engines = reward_up.result() if reward_up is not None else None
        self.teacher_engines = teacher_up.result() if teacher_up is not None else None
        # the one owner of the trained engines' weights: every push and re-sync goes through it
        fuse = cfg.rollout.max_staleness == 0 and not cfg.cluster.offload  # the engines wait idle for the push
        self.weights = WeightSync(
            self.actor, self.engines, self.resumed_version, fuse, shared=cfg.rollout.fleet is not None
        )
        self.schedule = self._make_schedule(pool_stop)
        sandbox.configure(cfg.sandbox)  # the code reward, the python/bash tools and your code use these settings
        if sandbox.used(cfg):
            with startup.phase("sandbox_up"):
                sandbox.pool()  # warm now: a node that cannot run the sandbox fails here, named
        rm_path, teacher_path = run.reward_model_path(cfg), run.teacher_path(cfg)
        self.generation = build_generation(
            cfg, tokenizer, self.weights.generate, len(layout.engine_slots),
            reward_model=Frozen(self.reward_engines, rm_path) if self.reward_engines is not None else None,
            teacher=Frozen(self.teacher_engines, teacher_path) if self.teacher_engines is not None else None,
            model_path=model_path, progress=progress, journal=self.journal,
        )  # fmt: skip
        reward_fn = self.generation.reward_fn
        # when the reward group worked (time/reward_idle); a judge's and a rule's are not timed
        self.reward_clock = reward_fn.clock if isinstance(reward_fn, MixedScorer) else None
        with startup.phase("weight_channel"):
            self.weights.connect()
        with startup.phase("first_push"):
            # engines just started hold their memory: nothing to resume (SGLang dies resuming memory it holds)
            self.weights.push(self.weights.trained)  # engines always start from the trained weights

        self.record: dict = {}  # metrics of the newest trained rollout
        # when the loop began (``begin``): the start-up phase ``first_rollout`` counts from there
        self.loop_began = time.monotonic()

    def _load_data(self, tokenizer: Any, context: int | None, vision: Vision | None) -> None:
        """The training rows in their order (a pure function of seed and rollout id), the eval sets,
        and how many rollouts the run has."""
        cfg = self.cfg
        prepare = prompt_prep(cfg, tokenizer, context, vision)
        self.buffer = load_train(cfg.data, cfg.rollout.rollout_batch_size, cfg.seed, prepare)
        self.eval_sets = cfg.eval.resolved_sets(cfg.data, cfg.rollout)
        self.eval_rows = load_eval_sets(cfg.data, self.eval_sets, prepare)
        self.num_rollout = cfg.rollout.num_rollout or self.buffer.num_rollout_per_epoch * cfg.rollout.num_epoch

    def _make_schedule(self, abort: AbortWhen) -> SyncRollouts | AsyncRollouts:
        """When each rollout is generated (rlhpc/schedule.py): inline, or ahead of training in a
        thread. It pushes through the weight owner and (async) restarts dead engines in a gap
        through the pool, which reports them to the owner."""
        cfg, stop = self.cfg, self.stop
        self.clock = BusyClock()
        self.staleness = cfg.rollout.max_staleness
        if self.staleness == 0:
            return SyncRollouts(self._generate, self.weights.push, self.clock, stop)
        requested = (lambda: stop.requested) if stop is not None else (lambda: False)
        return AsyncRollouts(
            self._generate, self.weights.push, self.clock, self.staleness, self.num_rollout, cfg.deterministic,
            requested, repair=self.engines.ensure_engines, partial=cfg.rollout.partial_rollout, abort=abort,
        )  # fmt: skip

    def _start_frozen_groups(self, layout: Any, pool_stop: Any) -> tuple[Any, Any]:
        """The reward model's and the teacher's engines, each started in a thread (None: no such group)."""
        cfg, run = self.cfg, self.rundir
        reward_up = teacher_up = None
        if cfg.reward_model is not None:
            rm_path = run.reward_model_path(cfg)
            reward_up = self.startup.background(
                "reward_engines_up",
                lambda: start_reward_engines(
                    cfg.reward_model, cfg.rollout, cfg.cluster, cfg.seed, rm_path, self.placement, layout,
                    run.engine_logs / "reward", pool_stop, cfg.deterministic,
                ),
            )  # fmt: skip
        if cfg.teacher is not None:
            teacher_path = run.teacher_path(cfg)
            teacher_up = self.startup.background(
                "teacher_engines_up",
                lambda: start_teacher_engines(
                    cfg.teacher, cfg.rollout, cfg.cluster, cfg.seed, teacher_path, self.placement, layout,
                    run.engine_logs / "teacher", pool_stop, cfg.deterministic,
                ),
            )  # fmt: skip
        return reward_up, teacher_up

    def _resume(self, staged: Staged) -> None:
        """Everything comes from the newest valid checkpoint on disk, nothing from the submission:
        the actor's weights and optimizer, the rollout to start at, the pending rollouts, the metrics."""
        cfg, run = self.cfg, self.rundir
        self.checkpoints = CheckpointManager(run.checkpoints, cfg.checkpoint.keep_last)
        self.checkpoints.clean_debris()  # staging left by a killed save
        # tool answers of episodes since the last checkpoint, replayed when they are generated again
        self.journal = ToolJournal(run.tool_journal) if cfg.rollout.tools and cfg.rollout.tool_journal else None
        if cfg.checkpoint.resume == "never":
            self.checkpoints.start_fresh()  # older checkpoints go to checkpoints/superseded-*/: never resumed from or deleted
            if self.journal is not None:
                self.journal.clear()  # what an earlier run recorded
        resume = self.checkpoints.latest() if cfg.checkpoint.resume == "auto" else None
        if resume is not None:
            self.buffer.check_resume(resume.state["data"])
            log.info(
                "resuming from %s: next rollout %d of %d", resume.path.name, resume.next_rollout_id, self.num_rollout
            )
        self.resumed_from = resume.rollout_id if resume else None
        self.start = resume.next_rollout_id if resume else 0
        # the weights' version the checkpoint holds (one per rollout trained); older checkpoints lack it
        self.resumed_version = resume.state.get("weight_version", self.start) if resume else 0
        self.saved = self.resumed_from if resume else -1  # newest rollout whose training is on disk
        with self.startup.phase("actor_load"):
            self.actor.load(staged.get(resume.path) if resume else None)  # the staged copy, if this one was staged
        self.pending = load_pending(resume.path) if resume else {}  # generated before the stop with weights now gone
        self.metrics = MetricsLogger(
            run, cfg.logging, config_to_dict(cfg), self.num_rollout, resume.state.get("wandb_id") if resume else None
        )
        self.metrics.rewind(self.start)
        if resume is not None:
            self.metrics.restore(resume.rollout_id, resume.state["metrics"])

    # ---- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        bar = (
            self.progress.add_task("training", total=self.num_rollout, completed=self.start) if self.progress else None
        )
        self.begin()
        for rollout_id in range(self.start, self.num_rollout):
            self.rollout(rollout_id)
            if bar is not None:
                self.progress.advance(bar)
        self.checkpoints.wait()  # the last checkpoint is committed before the run counts as finished
        self.metrics.wait_dumps()  # and the last rollout dump written

    def begin(self) -> None:
        """Before this start's first rollout: the evaluations owed, then the schedule."""
        self._catch_up_evals()
        self.loop_began = time.monotonic()
        self.schedule.start(self.start, self.pending)

    def rollout(self, rollout_id: int) -> None:
        """One turn of the loop: the step, its record logged and dumped, an evaluation when due."""
        self.stop_if_requested(rollout_id)
        generated, record = self.step(rollout_id)
        self.metrics.log("rollout", rollout_id, record)
        self.startup.first_rollout_done(self.loop_began)  # once per start
        self.metrics.dump_rollout(rollout_id, generated.batch, generated.texts)
        if self.eval_due(rollout_id):
            self.evaluate(rollout_id)

    def step(self, rollout_id: int) -> tuple[Generated, dict]:
        """Get rollout ``rollout_id``, train it, save if due, push the new weights; its record."""
        cfg = self.cfg
        timer = Timer()
        step_start = time.perf_counter()
        with timer("step"):
            with timer("generate" if self.staleness == 0 else "wait_rollout"):
                generated = self._get(rollout_id)
            rollout_metrics = {k: v for k, v in generated.metrics.items() if k != "time/generate"}
            if self.staleness > 0:
                timer["time/generate"] = generated.metrics["time/generate"]
            if cfg.cluster.offload:
                self.engines.offload()
            with timer("train"):
                kl_metrics: dict[str, float] = {}
                if cfg.algo.kl_in_reward:  # with the weights about to be trained: the same when resumed
                    generated, kl_metrics = self._kl_in_reward(generated)
                train_metrics = self.weights.train(rollout_id, generated.batch)  # (the push with it, when fused)
                train_metrics.update(kl_metrics)
            if (pushed_s := train_metrics.pop("time/update_weights", None)) is not None:
                timer["time/train"] -= pushed_s  # the push made in the same call counts as the push
                timer["time/update_weights"] = pushed_s
            self.record = {**rollout_metrics, **train_metrics, **timer}
            epoch_end = self.epoch_end(rollout_id)
            last = rollout_id == self.num_rollout - 1
            if every(cfg.checkpoint.save_interval, rollout_id, epoch_end) or last or self._stop_requested():
                with timer("save"):
                    self.save(rollout_id)
            if cfg.cluster.offload:
                self.actor.offload()
                self.engines.onload()
            with timer("update_weights"):  # after a push made with training: nothing left to do
                self.schedule.push(self.weights.trained)
        if (write_s := self.checkpoints.collect()) is not None:  # a save's background write + commit
            timer["time/save_write"] = write_s
        step = timer["time/step"]
        timer["time/actor_idle"] = max(0.0, 1.0 - (timer["time/train"] + timer.get("time/save", 0.0)) / step)
        timer["time/rollout_idle"] = self.clock.idle_fraction(step_start, step_start + step)
        if self.reward_clock is not None:  # the reward group: idle unless a /classify is in flight
            timer["time/reward_idle"] = self.reward_clock.idle_fraction(step_start, step_start + step)
        self.record = {**rollout_metrics, **train_metrics, **timer}
        return generated, self.record

    def _catch_up_evals(self) -> None:
        """Evaluations owed before the loop: the untrained baseline, and the one after the rollout
        resumed from when a stop (or a kill) came between its checkpoint and its evaluation (the
        engines hold the same weights again, so it runs now, once)."""
        logged = {m["rollout_id"] for m in read_metrics(self.rundir) if m["kind"] == "eval"}
        # once: a job killed before its first checkpoint logged the baseline already (rewind keeps it)
        if self.cfg.eval.interval is not None and self.start == 0 and -1 not in logged:
            self.stop_if_requested(0)
            with self.startup.phase("first_eval"):
                self.evaluate(-1)
        if self.resumed_from is not None and self.eval_due(self.resumed_from) and self.resumed_from not in logged:
            self.stop_if_requested(self.start)
            with self.startup.phase("first_eval"):
                self.evaluate(self.resumed_from)

    # ---- the phases ---------------------------------------------------------------------

    def _generate(self, rollout_id: int) -> Generated:
        start_s = time.perf_counter()
        # Async: this runs beside training, so a dead engine is restarted by the main thread, between rollouts.
        with self.engines.restarts_deferred() if self.staleness > 0 else nullcontext():
            batch, rollout_metrics, texts = self.generation.rollout(
                rollout_id,
                self.buffer.batch(rollout_id),
                lambda k, count: self.buffer.extra_rows(rollout_id, k, count),
            )
        # engines serving at the end of the rollout: fewer after a node loss, back after it rejoined
        extra = {"rollout/num_engines": self.engines.num_engines, "time/generate": time.perf_counter() - start_s}
        return Generated(rollout_id, batch, {**rollout_metrics, **extra}, texts)

    def _kl_in_reward(self, generated: Generated) -> tuple[Generated, dict[str, float]]:
        """``algo.kl_in_reward``: the rollout with each reward less kl_coef x its KL to the
        reference, and the advantages of those; its metric. A new batch: a pending rollout's
        checkpointed copy stays as generated (its penalty is measured when it is trained)."""
        a, b = self.cfg.algo, generated.batch
        rewards, advantages, penalty = kl_in_reward(
            b.rewards, self.actor.kl_to_reference(b), a.kl_coef, a.advantage_estimator, b.group_size, a.normalize_std
        )
        batch = dataclasses.replace(b, rewards=rewards, advantages=advantages)
        return dataclasses.replace(generated, batch=batch), {"kl/reward_penalty": penalty.mean().item()}

    def _get(self, rollout_id: int) -> Generated:
        try:
            return self.schedule.get(rollout_id)
        except GenerationAborted:  # cut short by a stop request: save what is trained, then stop
            self.stop_if_requested(rollout_id)
            raise

    def save(self, rollout_id: int) -> None:
        generated = self.schedule.pending(rollout_id)  # deterministic async: waits for what needs older weights
        state = {
            "data": self.buffer.state_dict(rollout_id + 1),
            "weight_version": self.weights.trained,  # the actor's, saved here; resumed from here
            "pending_rollouts": sorted(generated),
            "wandb_id": self.metrics.wandb_id,
            "metrics": self.record,  # restored if the job dies before the record reaches metrics.jsonl
            "restarts": read_history(self.rundir),
        }

        def snapshot(staging: Path) -> Callable[[], dict]:
            self.actor.snapshot(str(staging))  # the ranks' state in host memory: all the loop waits for
            save_pending(staging, generated)
            return self.actor.write_snapshot  # the ranks write it on their checkpoint threads

        # A failed save leaves nothing half-written; a background one raises at the next wait.
        self.checkpoints.save_async(rollout_id, snapshot, state, background=self.cfg.checkpoint.async_save)
        if self.journal is not None and (oldest := self.checkpoints.oldest()) is not None:
            self.journal.prune(oldest)  # no resume goes back past the oldest checkpoint kept
        if not self.cfg.checkpoint.async_save:
            self.checkpoints.wait()
        self.saved = rollout_id

    def _stop_requested(self) -> bool:
        return self.stop is not None and self.stop.requested

    def stop_if_requested(self, next_rollout_id: int) -> None:
        """A safe point: on a stop request, make sure the newest training is saved, then stop."""
        if not self._stop_requested():
            return
        if next_rollout_id - 1 > self.saved:
            log.warning("%s: saving rollout %d before stopping", self.stop.name, next_rollout_id - 1)
            self.save(next_rollout_id - 1)
        self.checkpoints.wait()  # the save in flight commits before the job requeues
        raise Stopped(next_rollout_id, self.stop.name)

    def evaluate(self, rollout_id: int) -> None:
        try:
            with self.schedule.exclusive():  # between two rollouts: the engines hold the newest weights
                values = evaluate_sets(self.generation, rollout_id, self.eval_sets, self.eval_rows)
        except GenerationAborted:
            log.warning("evaluation after rollout %d cut short by a stop request; it runs again at resume", rollout_id)
            self.stop_if_requested(rollout_id + 1)
            raise
        self.metrics.log("eval", rollout_id, values)

    def eval_due(self, rollout_id: int) -> bool:
        last = rollout_id == self.num_rollout - 1
        interval = self.cfg.eval.interval
        return every(interval, rollout_id, self.epoch_end(rollout_id)) or (last and interval is not None)

    def epoch_end(self, rollout_id: int) -> bool:
        """An epoch's end, when the run is counted in epochs (rollout.num_rollout unset), saves and
        evaluates as the seed's loop does; a run counted in rollouts keeps to its intervals."""
        return self.cfg.rollout.num_rollout is None and self.buffer.is_epoch_end(rollout_id)

    # ---- the end ------------------------------------------------------------------------

    def close(self) -> None:
        """Always, also when leaving on an error: the save in flight still commits if it can."""
        try:
            if self.checkpoints.in_flight is not None:
                try:
                    self.checkpoints.wait()
                except Exception as e:
                    log.warning("the checkpoint save in flight failed too: %s", e)
        finally:
            self.schedule.close()
            self.metrics.close()
            sandbox.close()

    def shutdown(self) -> None:
        """After a run that ended well: the engines, the ranks and the GPUs' reservation."""
        self.engines.shutdown()
        for frozen in (self.reward_engines, self.teacher_engines):
            if frozen is not None:
                frozen.shutdown()
        self.actor.shutdown()
        self.placement.remove()


def make_progress(console=None) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
