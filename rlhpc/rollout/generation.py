"""One generation step, without Ray: rows -> /generate requests -> samples -> rewards -> advantages.

The requests go out through a ``Send``: the engine pool (``rlhpc.rollout.engines``, which
spreads them over the engines and restarts dead ones), or ``one_batch(client)`` for a single
engine server (``tools/gpu_check.py``). The samplers (``rlhpc.rollout.sampler``: plain,
environment, custom) make the samples; ``Generation`` turns them into a rollout or an evaluation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rlhpc.algo.grpo import ADVANTAGE_ESTIMATORS, overlong_penalty
from rlhpc.algo.pass_at_k import pass_metrics
from rlhpc.batch import RolloutBatch
from rlhpc.data.dynamic_sampling import Group, GroupFilter, resolve_filter
from rlhpc.data.rows import Row, as_rows
from rlhpc.data.tasks import TASKS, RewardFn, resolve_reward
from rlhpc.errors import RlhpcError, user_code_error
from rlhpc.rollout.custom import CustomRollout, CustomSampler
from rlhpc.rollout.journal import ToolJournal, scope_name
from rlhpc.rollout.plain import PlainSampler
from rlhpc.rollout.sampler import Draw, Sampler, Sampling
from rlhpc.rollout.samples import Samples
from rlhpc.rollout.scoring import MixedScorer, PooledReward, RemoteReward, Scorer, is_remote
from rlhpc.wire.request import Request, Send, knob_params

if TYPE_CHECKING:
    from rich.progress import Progress

    from rlhpc.config import AlgoConfig, DataConfig, EvalConfig, EvalSetConfig, RolloutConfig
    from rlhpc.rollout.episodes import EpisodeConfig

log = logging.getLogger(__name__)

MoreRows = Callable[[int, int], list[dict]]  # (round, count) -> prompts to over-sample
# (prompt ids, response ids) per sample -> each response token's logprob under the teacher
TeacherLogprobs = Callable[[list[list[int]], list[list[int]]], list[list[float]]]


def task_reward(data: DataConfig) -> Scorer:
    """``data.reward`` if set, else the task's own reward, as a ``Scorer``."""
    if data.reward and is_remote(data.reward):
        remote = RemoteReward(data.reward, data.reward_timeout_s, data.reward_concurrency, data.reward_key_file)
        return Scorer(remote, data.reward, data.reward_errors)
    if data.reward and data.reward_workers:
        return Scorer(
            PooledReward(data.reward, data.reward_workers, data.reward_timeout_s), data.reward, data.reward_errors
        )
    if data.reward:
        return Scorer(resolve_reward(data.reward), data.reward, data.reward_errors)
    return Scorer(TASKS[data.task].reward, f"the {data.task} task's reward", data.reward_errors)


class Generates(Protocol):
    """What ``one_batch`` sends through (``rlhpc.wire.client.EngineClient``)."""

    def generate(self, *, input_ids: Any, sampling_params: Any, return_logprob: bool) -> Any: ...


def one_batch(client: Generates) -> Send:
    """A ``Send`` for one engine and no Ray or restarts: all requests as a single /generate call,
    so the engine samples the whole rollout as one batch."""

    def send(requests: Sequence[Request], done: Callable[[int, list[dict]], None]) -> list[list[dict]]:
        images = [imgs for r in requests for imgs in (r.image_data or [[]] * len(r.input_ids))]
        outputs = client.generate(
            input_ids=[ids for r in requests for ids in r.input_ids],
            sampling_params=[p for r in requests for p in r.sampling_params],
            return_logprob=any(r.return_logprob for r in requests),
            **({"image_data": images} if any(images) else {}),
            **({"return_routed_experts": True} if any(r.return_routed_experts for r in requests) else {}),
        )
        answers, start = [], 0
        for c, r in enumerate(requests):
            answers.append(outputs[start : start + len(r.input_ids)])
            start += len(r.input_ids)
            done(c, answers[-1])
        return answers

    return send


class Generation:
    """Sample, score and turn rewards into advantages for a rollout (or an evaluation).

    ``progress``, when given, shows one bar per phase (rows done). ``num_engines``: the engines
    the run is configured with; a batch is sent in requests that spread it over them.
    """

    def __init__(
        self,
        tokenizer: Any,
        reward_fn: Scorer | MixedScorer | RewardFn,
        rollout: RolloutConfig,
        eval: EvalConfig,
        algo: AlgoConfig,
        seed: int,
        send: Send,
        progress: Progress | None = None,
        num_engines: int = 1,
        episodes: EpisodeConfig | None = None,
        custom: CustomRollout | None = None,
        teacher: TeacherLogprobs | None = None,
        journal: ToolJournal | None = None,
        routing_shape: tuple[int, int, int] | None = None,
    ):
        """``routing_shape``: with algo.routing_replay, the MoE model's (layers, experts per
        token, experts) (``rlhpc.model.routing_shape``)."""
        self.tokenizer = tokenizer
        self.routing_shape = routing_shape
        self.teacher = teacher  # each trained token's logprob under the teacher (issue 30), or None
        self.journal = journal  # episodes' tool answers, recorded and replayed (rlhpc.rollout.journal)
        self.reward_fn = (
            reward_fn
            if isinstance(reward_fn, Scorer | MixedScorer)
            else Scorer(reward_fn, getattr(reward_fn, "__name__", "reward"))
        )
        self.rollout_cfg, self.eval_cfg, self.algo_cfg = rollout, eval, algo
        self.seed = seed
        self.send = send
        self.num_engines = num_engines
        self.progress = progress
        self.episodes = episodes  # multi-turn: every sample is an episode of this environment
        self.custom = custom  # rollout.generate_fn / rollout.agent: every sample from its code
        self.train_params = knob_params(rollout.top_k, rollout.min_p, rollout.repetition_penalty, rollout.stop)
        spec = rollout.dynamic_sampling.filter
        self.group_filter: GroupFilter | None = resolve_filter(spec) if spec is not None else None

    def sample(
        self,
        rows: list[Row],
        n: int,
        temperature: float,
        max_new_tokens: int,
        seed_tag: object,
        desc: str,
        params: dict[str, Any] | None = None,
        journal_scope: str | None = None,
    ) -> Samples:
        """Sample ``n`` responses per row, in requests of a few rows each, and score them.
        ``params``: further sampling params of every request (``knob_params``); ``journal_scope``:
        the tool journal's file of this generation (``rlhpc.rollout.journal.scope_name``).

        A request's rows depend only on the row index, and every sample has its own seed, so a
        rerun sends exactly the same batches and gets the same tokens.
        """
        draw = Draw(as_rows(rows), n, temperature, max_new_tokens, seed_tag, desc, params or {}, journal_scope)
        return self.sampler().sample(draw)

    def sampler(self) -> Sampler:
        """The run's sampler: its generate function's or agent's, its environment's, or the plain
        one; made per call, from what this generation holds now."""
        run = Sampling(
            self.tokenizer,
            self.reward_fn,
            self.seed,
            self.send,
            self.num_engines,
            self.rollout_cfg.top_p,
            self.progress,
        )
        if self.custom is not None:
            return CustomSampler(run, self.custom)
        if self.episodes is not None:
            from rlhpc.rollout.environment import EnvironmentSampler

            return EnvironmentSampler(run, self.episodes, self.journal)
        # (an evaluation alone, rlhpc-evaluate, trains nothing: given no shape, it asks for none)
        replay = self.algo_cfg.routing_replay and self.routing_shape is not None
        return PlainSampler(run, self.routing_shape if replay else None)

    def rollout(
        self, rollout_id: int, rows: list[dict], more_rows: MoreRows | None = None
    ) -> tuple[RolloutBatch, dict[str, float], dict[str, list[str]]]:
        """One rollout of ``rows``: the training batch, its metrics and its texts. With dynamic
        sampling, ``more_rows(round, count)`` gives the prompts to over-sample (``DataBuffer.extra_rows``)."""
        r, algo = self.rollout_cfg, self.algo_cfg
        n = r.n_samples_per_prompt
        filter_metrics: dict[str, float] = {}
        if self.group_filter is None:
            desc = f"rollout {rollout_id}"
            s = self.sample(
                rows, n, r.temperature, r.max_new_tokens, rollout_id, desc, self.train_params, scope_name(rollout_id)
            )
        else:
            if more_rows is None:
                raise RlhpcError(
                    "dynamic sampling needs more prompts than the rollout's own, and none were given",
                    "pass more_rows (the driver passes DataBuffer.extra_rows)",
                )
            s, filter_metrics = self._filtered(rollout_id, rows, more_rows)
        lengths = torch.tensor([len(x) for x in s.response_ids], dtype=torch.float32)
        # DAPO's soft overlong penalty joins the reward the advantages are computed from; the
        # logged "reward" stays the task's, comparable across runs with and without it.
        penalty = overlong_penalty(lengths, r.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
        rewards = s.rewards + penalty if algo.overlong_buffer else s.rewards
        advantages = ADVANTAGE_ESTIMATORS[algo.advantage_estimator](s.episode_rewards(rewards), n, algo.normalize_std)
        if s.episode_of:  # an agent episode's samples share its advantage
            advantages = advantages[torch.tensor(s.episode_of)]
        loss_masks, overlong_metrics = self._overlong_masks(s)
        loss_masks, infra_metrics = self._unscored_masks(s, loss_masks)
        batch = RolloutBatch(
            s.prompt_ids, s.response_ids, s.logprobs, rewards, advantages, n, s.weight_versions, s.token_versions,
            loss_masks, s.turns, s.cut() if s.loss_masks or r.overlong_filter else [], images=s.images,
            routed_experts=s.routed_experts,
        )  # fmt: skip
        if algo.overlong_buffer:
            overlong_metrics["overlong/penalty"] = penalty.mean().item()
        teacher_metrics = {}
        if self.teacher is not None:  # the samples trained on, after any filtering
            if s.images:
                raise RlhpcError(
                    "a teacher scores token ids only, and this rollout's prompts hold images it would not see",
                    "drop the teacher section for image data (docs/guides/multimodal.md)",
                )
            start = time.perf_counter()
            batch.teacher_logprobs = self.teacher(s.prompt_ids, s.response_ids)
            teacher_metrics["time/teacher"] = time.perf_counter() - start
        staleness = [rollout_id - v for v in s.weight_versions]
        tokens = sum(map(len, s.token_versions))
        scored = s.rewards[~torch.isnan(s.rewards)]
        metrics = {
            "reward": scored.mean().item() if len(scored) else 0.0,
            "reward_std": scored.std(unbiased=False).item() if len(scored) else 0.0,
            **infra_metrics,
            "response_len": lengths.mean().item(),
            "samples": float(len(batch)),
            "staleness/mean": sum(staleness) / max(len(staleness), 1),
            "staleness/max": float(max(staleness, default=0)),
            "staleness/token_mean": sum(rollout_id - v for t in s.token_versions for v in t) / max(tokens, 1),
            # share of samples whose tokens come from more than one weight version (partial rollouts)
            "staleness/straddling": sum(len(set(v)) > 1 for v in s.token_versions) / max(len(batch), 1),
            **s.part_metrics(),
            **s.episode_metrics(),
            # a generate function's or agent's episodes: samples per episode (an agent's may give several)
            **({"episode/samples": len(batch) / s.num_episodes()} if self.custom is not None else {}),
            **filter_metrics,
            **overlong_metrics,
            **teacher_metrics,
        }
        return batch, metrics, s.texts

    @staticmethod
    def _unscored_masks(s: Samples, masks: list[list[int]]) -> tuple[list[list[int]], dict[str, float]]:
        """The loss masks with every unscored sample's all 0 (its reward is NaN: a sandbox that
        could not run, ``InfrastructureFailure``; the advantages leave it out of its group's
        baseline), and how many there were (``infra/failed``)."""
        unscored = torch.isnan(s.rewards).tolist()
        if any(unscored):
            masks = masks or [[1] * len(ids) for ids in s.response_ids]
            masks = [[0] * len(m) if u else m for m, u in zip(masks, unscored)]
        return masks, {"infra/failed": float(sum(unscored))}

    def _overlong_masks(self, s: Samples) -> tuple[list[list[int]], dict[str, float]]:
        """``rollout.overlong_filter``: the loss masks with every cut sample's all 0 (its reward
        judged an unfinished answer; it still counts in its group's baseline), and how many."""
        if not self.rollout_cfg.overlong_filter:
            return s.loss_masks, {}
        cut = s.cut()
        # single-turn samples have no masks of their own: every response token counts
        masks = s.loss_masks or [[1] * len(ids) for ids in s.response_ids]
        masks = [[0] * len(m) if c else m for m, c in zip(masks, cut)]
        return masks, {"overlong/filtered": float(sum(cut))}

    def _keep(self, group: Group) -> bool:
        """The dynamic-sampling filter's verdict on ``group``; the filter raising is its error."""
        assert self.group_filter is not None
        try:
            return bool(self.group_filter(group))
        except RlhpcError:
            raise
        except Exception as e:
            spec = self.rollout_cfg.dynamic_sampling.filter
            on = f"the group of prompt {group.prompt[-80:]!r} (label {group.answer[:40]!r})"
            raise user_code_error(f"the sampling filter {spec}", e, on) from e

    def _filtered(self, rollout_id: int, rows: list[dict], more_rows: MoreRows) -> tuple[Samples, dict[str, float]]:
        """Dynamic sampling: rounds of ``over_sampling_batch_size`` prompts (the first: the rollout's
        own rows, then extra ones) until ``len(rows)`` groups pass the filter, at most ``max_rounds``;
        short of that, dropped groups fill the batch (in generation order, so reruns match).
        Round 0 samples its rows with the seeds of an unfiltered rollout."""
        r, ds = self.rollout_cfg, self.rollout_cfg.dynamic_sampling
        n, want = r.n_samples_per_prompt, len(rows)
        per_round = ds.over_sampling_batch_size or want
        kept: list[Samples] = []
        dropped: list[Samples] = []
        num_kept = num_dropped = rounds = 0
        reward_sum = 0.0
        while num_kept < want and rounds < ds.max_rounds:
            round_rows = rows + more_rows(0, per_round - want) if rounds == 0 else more_rows(rounds, per_round)
            tag = rollout_id if rounds == 0 else f"{rollout_id}/{rounds}"
            desc = f"rollout {rollout_id} round {rounds}"
            s = self.sample(
                round_rows, n, r.temperature, r.max_new_tokens, tag, desc, self.train_params, scope_name(tag)
            )
            verdicts = [self._keep(s.group(g, n)) for g in range(len(round_rows))]
            keep = [g for g, v in enumerate(verdicts) if v]
            kept.append(s.groups(n, keep))
            dropped.append(s.groups(n, [g for g, v in enumerate(verdicts) if not v]))
            num_kept += len(keep)
            num_dropped += len(verdicts) - len(keep)
            reward_sum += s.episode_rewards(s.rewards).sum().item()
            rounds += 1
        short = max(0, want - num_kept)
        if short:
            log.warning(
                "rollout %d: only %d of %d prompt groups passed %s after %d round(s); %d dropped group(s) fill the batch",
                rollout_id, num_kept, want, ds.filter, rounds, short,
            )  # fmt: skip
        chosen = Samples.concat([*kept, *dropped])
        s = chosen.groups(n, list(range(want)))  # the kept groups first, then (short) dropped ones
        metrics = {
            "dynamic_sampling/kept": float(num_kept),
            "dynamic_sampling/dropped": float(num_dropped),
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/short": float(short),
            # over every sample generated, dropped ones too ("reward" is over the trained batch)
            "dynamic_sampling/reward_generated": reward_sum / ((num_kept + num_dropped) * n),
        }
        return s, metrics

    def evaluate(self, rollout_id: int, rows: list[dict], eval_set: EvalSetConfig, seed_tag: str) -> dict[str, float]:
        """Mean reward, response length, pass@k and maj@n (``rlhpc.algo.pass_at_k``) on ``rows``
        after ``rollout_id``, sampled as ``eval_set`` says (``EvalConfig.resolved_sets``: every
        key given). ``seed_tag``: the sampling seeds' tag, one per set (``eval_split``)."""
        e = self.eval_cfg
        n, desc = eval_set.n_samples_per_prompt, f"{seed_tag} after {rollout_id}"
        params = knob_params(eval_set.top_k, eval_set.min_p, eval_set.repetition_penalty, eval_set.stop)
        scope = scope_name(seed_tag, rollout_id)
        s = self.sample(rows, n, eval_set.temperature, eval_set.max_new_tokens, seed_tag, desc, params, scope)
        s = s.last_per_episode()  # pass@k counts episodes
        unscored = torch.isnan(s.rewards)  # failed for infrastructure: out of the mean, not passed in pass@k
        return {
            "reward": s.rewards[~unscored].mean().item() if not unscored.all() else 0.0,
            "infra/failed": float(unscored.sum()),
            "response_len": sum(map(len, s.response_ids)) / len(s.response_ids),
            **pass_metrics(s.rewards.tolist(), s.texts["response"], n, e.pass_threshold),
            **s.part_metrics(),
            **s.episode_metrics(),
        }
