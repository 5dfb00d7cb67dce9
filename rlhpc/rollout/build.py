"""The one place a run's ``Generation`` is put together from its config: the reward (the task's or
``data.reward``, mixed with the reward model's or the judge's), the episodes' environment or the
user's generate function or agent, the teacher, routing replay. The driver, rlhpc-eval and the
tools build theirs here, so an evaluation scores as the run it evaluates does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhpc.errors import RlhpcError
from rlhpc.model import context_length, load_tokenizer, routing_shape
from rlhpc.rollout.custom import make_custom
from rlhpc.rollout.episodes import make_episodes
from rlhpc.rollout.generation import Generation, task_reward
from rlhpc.rollout.judge import Judge
from rlhpc.rollout.reward_model import RewardModel
from rlhpc.rollout.scoring import MixedScorer, Scorer
from rlhpc.rollout.teacher import Teacher, check_same_vocabulary
from rlhpc.wire.request import Send

if TYPE_CHECKING:
    from rich.progress import Progress

    from rlhpc.config import Config
    from rlhpc.data.tasks import RewardFn
    from rlhpc.rollout.journal import ToolJournal


@dataclass(frozen=True)
class Frozen:
    """A frozen model's engines (``rlhpc.rollout.engines.EnginePool``) and its weights' directory."""

    engines: Any
    path: str


def run_reward(cfg: Config, reward_model: Frozen | None) -> Scorer | MixedScorer:
    """The run's reward: the task's or ``data.reward``, mixed with the reward model's or the judge's
    (``reward_model``: their engines, which a config with a ``reward_model`` section needs)."""
    reward = task_reward(cfg.data)
    rm_cfg = cfg.reward_model
    if rm_cfg is None:
        return reward
    if reward_model is None:
        raise RlhpcError(
            "the config has a reward_model section, and no reward model engines were given to score with",
            "start them (rlhpc.rollout.reward_model.start_reward_engines) and pass them to build_generation",
        )
    tokenizer, context = load_tokenizer(reward_model.path), context_length(reward_model.path)
    if rm_cfg.kind == "judge":  # scored once generation is done (a judge's answers are generations too)
        judge = Judge(reward_model.engines, tokenizer, rm_cfg, cfg.seed, context)
        return MixedScorer(reward, cfg.data.reward_weight, {"reward_model": (rm_cfg.weight, judge.score)})
    rm = RewardModel(reward_model.engines, tokenizer, rm_cfg.batch_size, context)
    return MixedScorer(
        reward, cfg.data.reward_weight, {"reward_model": (rm_cfg.weight, rm.score)},
        groups={"reward_model": rm.score_groups}, overlap=rm_cfg.overlap, clock=rm.clock,
    )  # fmt: skip


def build_generation(
    cfg: Config,
    tokenizer: Any,
    send: Send,
    num_engines: int = 1,
    *,
    reward_model: Frozen | None = None,
    teacher: Frozen | None = None,
    reward: Scorer | MixedScorer | RewardFn | None = None,
    model_path: str | None = None,
    progress: Progress | None = None,
    journal: ToolJournal | None = None,
) -> Generation:
    """The run's ``Generation``, sending through ``send`` to ``num_engines`` engines (the configured
    count). ``reward``: a scorer in place of the run's (a tool's own); ``model_path``: the policy's,
    for algo.routing_replay (None: no routing asked for, as an evaluation alone trains nothing)."""
    teacher_logprobs = None
    if teacher is not None:  # the teacher's logprobs of the trained tokens, once its vocabulary is the policy's
        check_same_vocabulary(tokenizer, load_tokenizer(teacher.path), teacher.path)
        teacher_logprobs = Teacher(teacher.engines, cfg.teacher.batch_size).logprobs
    replay = cfg.algo.routing_replay and model_path is not None
    return Generation(
        tokenizer, reward if reward is not None else run_reward(cfg, reward_model), cfg.rollout, cfg.eval, cfg.algo,
        cfg.seed, send, progress=progress, num_engines=num_engines, episodes=make_episodes(cfg, tokenizer),
        custom=make_custom(cfg, tokenizer), teacher=teacher_logprobs, journal=journal,
        routing_shape=routing_shape(model_path) if replay else None,
    )  # fmt: skip
