"""One generation step, without Ray: rows -> /generate requests -> samples -> rewards -> advantages.

The requests go out through a ``Send``: the engine pool (``rlhpc.rollout.engines``, which
spreads them over the engines and restarts dead ones), or ``one_batch(client)`` for a single
engine server (``tools/gpu_check.py``). A request's rows depend only on the row index and every
sample has its own seed, so a rerun, or a request sent again after an engine restart, gets the
same tokens.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rlhpc.algo.grpo import ADVANTAGE_ESTIMATORS, overlong_penalty
from rlhpc.algo.pass_at_k import pass_metrics
from rlhpc.batch import RolloutBatch
from rlhpc.data.dynamic_sampling import Group, GroupFilter, resolve_filter
from rlhpc.data.prompts import encode_rows
from rlhpc.data.rows import Row, as_rows
from rlhpc.data.tasks import TASKS, RewardFn, resolve_reward
from rlhpc.errors import RlhpcError, user_code_error
from rlhpc.rollout.custom import CustomRollout, run_custom
from rlhpc.rollout.journal import ToolJournal, scope_name
from rlhpc.rollout.scoring import MixedScorer, PooledReward, RemoteReward, Sample, Scorer, is_remote
from rlhpc.wire.protocol import finish_reason, routed_experts, token_versions, weight_version
from rlhpc.wire.request import Request, Send, knob_params, sample_seed

if TYPE_CHECKING:
    from rich.progress import Progress

    from rlhpc.config import AlgoConfig, DataConfig, EvalConfig, EvalSetConfig, RolloutConfig
    from rlhpc.rollout.episodes import EpisodeConfig

log = logging.getLogger(__name__)

MoreRows = Callable[[int, int], list[dict]]  # (round, count) -> prompts to over-sample
# (prompt ids, response ids) per sample -> each response token's logprob under the teacher
TeacherLogprobs = Callable[[list[list[int]], list[list[int]]], list[list[float]]]

# At most this many samples per /generate request: a request is one engine batch on the CPU
# engine (SGLang batches across requests anyway), and a bar step.
MAX_SAMPLES_PER_REQUEST = 256


def rows_per_request(num_rows: int, n: int, num_engines: int) -> int:
    """Rows per /generate request: the batch spread evenly over the engines, in requests of at
    most MAX_SAMPLES_PER_REQUEST samples (at least one row). ``num_engines`` is the configured
    count, not the live one, so a run sends the same requests whatever engines it loses."""
    per_engine = -(-num_rows // max(1, num_engines))
    return max(1, min(per_engine, MAX_SAMPLES_PER_REQUEST // n))


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


def image_uris(rows: list[Row]) -> list[list[str]]:
    """Each row's images as SGLang's ``image_data`` takes them (data URIs, encoded once per row,
    not per sample); empty when no row has any."""
    if not any(r.images for r in rows):
        return []
    return [[ref.uri() for ref in r.images] for r in rows]


def _samples(rows: list[Row], n: int, row_of: Sequence[int], outputs: Sequence[dict]) -> list[Sample]:
    """What the reward reads of each output: ``outputs[k]`` answers row ``row_of[k]``."""
    return [
        Sample(
            prompt=rows[i].prompt_text, response=out["text"], label=rows[i].label,
            response_ids=list(out["output_ids"]), messages=rows[i].messages if rows[i].is_chat else None,
            row=rows[i], finish_reason=finish_reason(out["meta_info"]),
        )
        for i, out in zip(row_of, outputs)
    ]  # fmt: skip


@dataclass
class Samples:
    """``n`` samples per row, row-major (a row's samples adjacent), scored."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    rewards: torch.Tensor
    texts: dict[str, list[str]]  # "prompt", "response", "answer" per sample
    weight_versions: list[int]  # the weights each sample was generated with (its oldest token's)
    token_versions: list[list[int]]  # per response token
    parts: dict[str, list[float]] = field(default_factory=dict)  # a dict reward's other parts, per sample
    # Multi-turn episodes only (empty for single-turn samples, whose response is all generated):
    loss_masks: list[list[int]] = field(default_factory=list)  # per response token: 1 generated, 0 observation
    turns: list[list[int]] = field(default_factory=list)  # per response token: its turn
    episode: dict[str, list[float]] = field(default_factory=dict)  # per sample: turns, truncated, ...
    finish_reasons: list[str | None] = field(default_factory=list)  # single-turn: the engine's, per sample
    # An agent's episode may give several samples (``trajectories.assemble``): per sample, its
    # episode's index (row-major, a row's n episodes adjacent). Empty: sample k is episode k.
    episode_of: list[int] = field(default_factory=list)
    # A vision-language model's: per sample, its prompt's images (``ImageRef``); empty: none has any.
    images: list[list] = field(default_factory=list)
    # algo.routing_replay: per sample, the experts the engine routed its tokens to (RolloutBatch's)
    routed_experts: list[torch.Tensor] = field(default_factory=list)

    def num_episodes(self) -> int:
        return self.episode_of[-1] + 1 if self.episode_of else len(self.response_ids)

    def episode_rewards(self, rewards: torch.Tensor) -> torch.Tensor:
        """``rewards`` (per sample) per episode: the mean of its samples' (all the episode's reward)."""
        if not self.episode_of:
            return rewards
        index = torch.tensor(self.episode_of)
        sums = torch.zeros(self.num_episodes()).index_add_(0, index, rewards.float())
        return sums / torch.bincount(index, minlength=self.num_episodes()).float()

    def last_per_episode(self) -> Samples:
        """Each episode's last sample (its final reply): one per episode, as evaluation and
        sampling filters count them."""
        if not self.episode_of:
            return self
        last = {e: k for k, e in enumerate(self.episode_of)}
        return self._select([last[e] for e in range(self.num_episodes())], [])

    def episode_metrics(self) -> dict[str, float]:
        """``episode/<stat>``: each episode statistic's mean over the samples."""
        return {f"episode/{key}": sum(v) / max(len(v), 1) for key, v in self.episode.items()}

    def part_metrics(self) -> dict[str, float]:
        """``reward/<part>``: each part's mean over the samples that have it (``errors``: the count)."""
        out = {}
        for key, values in self.parts.items():
            have = [v for v in values if not math.isnan(v)]
            out[f"reward/{key}"] = sum(have) if key == "errors" else sum(have) / max(len(have), 1)
        return out

    def group(self, g: int, n: int) -> Group:
        """Group ``g`` (a prompt's n samples), as a dynamic-sampling filter sees it."""
        if self.episode_of:
            return self.last_per_episode().group(g, n)
        t, span = self.texts, slice(g * n, (g + 1) * n)
        return Group(t["prompt"][g * n], t["answer"][g * n], t["response"][span], self.rewards[span].tolist())

    def groups(self, n: int, keep: Sequence[int]) -> Samples:
        """Groups ``keep`` (a prompt's n samples each, in this order) as Samples of their own."""
        if self.episode_of:  # the samples of the groups' episodes, renumbered
            where = {g: i for i, g in enumerate(keep)}
            idx = [k for g in keep for k, e in enumerate(self.episode_of) if e // n == g]
            return self._select(idx, [where[self.episode_of[k] // n] * n + self.episode_of[k] % n for k in idx])
        return self._select([g * n + j for g in keep for j in range(n)], [])

    def _select(self, idx: list[int], episode_of: list[int]) -> Samples:
        return Samples(
            [self.prompt_ids[k] for k in idx],
            [self.response_ids[k] for k in idx],
            [self.logprobs[k] for k in idx],
            self.rewards[idx] if idx else self.rewards[:0],
            {key: [v[k] for k in idx] for key, v in self.texts.items()},
            [self.weight_versions[k] for k in idx],
            [self.token_versions[k] for k in idx],
            {key: [v[k] for k in idx] for key, v in self.parts.items()},
            [self.loss_masks[k] for k in idx] if self.loss_masks else [],
            [self.turns[k] for k in idx] if self.turns else [],
            {key: [v[k] for k in idx] for key, v in self.episode.items()},
            [self.finish_reasons[k] for k in idx] if self.finish_reasons else [],
            episode_of,
            [self.images[k] for k in idx] if self.images else [],
            [self.routed_experts[k] for k in idx] if self.routed_experts else [],
        )

    @staticmethod
    def concat(parts: Sequence[Samples]) -> Samples:
        return Samples(
            [x for p in parts for x in p.prompt_ids],
            [x for p in parts for x in p.response_ids],
            [x for p in parts for x in p.logprobs],
            torch.cat([p.rewards for p in parts]),
            {key: [x for p in parts for x in p.texts[key]] for key in parts[0].texts},
            [x for p in parts for x in p.weight_versions],
            [x for p in parts for x in p.token_versions],
            {
                key: [x for p in parts for x in p.parts.get(key, [math.nan] * len(p.rewards))]
                for key in dict.fromkeys(k for p in parts for k in p.parts)
            },
            [x for p in parts for x in p.loss_masks],
            [x for p in parts for x in p.turns],
            {key: [x for p in parts for x in p.episode.get(key, [])] for key in parts[0].episode},
            [x for p in parts for x in p.finish_reasons],
            Samples._concat_episodes(parts),
            [x for p in parts for x in (p.images or [[]] * len(p.response_ids))]
            if any(p.images for p in parts)
            else [],
            [x for p in parts for x in p.routed_experts],
        )

    @staticmethod
    def _concat_episodes(parts: Sequence[Samples]) -> list[int]:
        if not any(p.episode_of for p in parts):
            return []
        out, start = [], 0
        for p in parts:
            out += [start + e for e in (p.episode_of or range(len(p.response_ids)))]
            start += p.num_episodes()
        return out

    def cut(self) -> list[bool]:
        """Per sample, whether it was cut short: a single-turn sample at max_new_tokens (finish
        reason "length"), an episode by max_turns or max_episode_tokens."""
        if self.loss_masks:
            return [bool(t) for t in self.episode.get("truncated", [0.0] * len(self.response_ids))]
        return [r == "length" for r in self.finish_reasons]


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
        params = params or {}
        rows = as_rows(rows)
        if self.custom is not None:
            return self._sample_custom(rows, n, temperature, max_new_tokens, seed_tag, desc, params)
        if self.episodes is not None:
            return self._sample_episodes(rows, n, temperature, max_new_tokens, seed_tag, desc, params, journal_scope)
        top_p = self.rollout_cfg.top_p
        per_request = rows_per_request(len(rows), n, self.num_engines)
        chunks = [range(i, min(i + per_request, len(rows))) for i in range(0, len(rows), per_request)]
        prompts = encode_rows(self.tokenizer, rows)
        uris = image_uris(rows)
        # (an evaluation alone, rlhpc-evaluate, trains nothing: given no shape, it asks for none)
        replay = self.algo_cfg.routing_replay and self.routing_shape is not None
        requests = [
            Request(
                return_routed_experts=replay,
                input_ids=[prompts[i] for i in chunk for _ in range(n)],
                image_data=[uris[i] for i in chunk for _ in range(n)] if uris else None,
                sampling_params=[
                    {
                        "max_new_tokens": max_new_tokens,
                        "temperature": temperature,
                        "top_p": top_p,
                        "sampling_seed": sample_seed(self.seed, seed_tag, i, j),
                        **params,
                    }
                    for i in chunk
                    for j in range(n)
                ],
            )
            for chunk in chunks
        ]

        progress = self.progress
        bar = progress.add_task(desc, total=len(rows)) if progress is not None else None
        # model components (the reward model) score each request's samples as it is answered
        ahead = self.reward_fn.start() if isinstance(self.reward_fn, MixedScorer) else {}

        def done(c: int, answer: list[dict]) -> None:
            if bar is not None:
                progress.advance(bar, len(chunks[c]))
            if ahead:
                group = _samples(rows, n, [i for i in chunks[c] for _ in range(n)], answer)
                for scores in ahead.values():
                    scores.add(c, group)

        try:
            answers = self.send(requests, done)
        except BaseException:
            for scores in ahead.values():
                scores.close()
            raise
        finally:
            if bar is not None:
                progress.remove_task(bar)

        outputs = [out for answer in answers for out in answer]  # row-major: a row's n samples adjacent
        response_ids = [list(out["output_ids"]) for out in outputs]
        logprobs = [[lp for lp, _tok, _ in out["meta_info"].get("output_token_logprobs", [])] for out in outputs]
        samples = _samples(rows, n, [k // n for k in range(len(outputs))], outputs)
        texts = {
            "prompt": [s.prompt for s in samples],
            # the engine's own detokenization (SGLang's: stop token trimmed, special tokens
            # skipped), not a second one here on the loop's critical path
            "response": [s.response for s in samples],
            "answer": [s.label for s in samples],
        }
        if ahead:
            ready = {name: scores.scores(range(len(requests))) for name, scores in ahead.items()}
            rewards, parts = self.reward_fn(samples, ready)
        else:
            rewards, parts = self.reward_fn(samples)
        prompt_ids = [prompts[k // n] for k in range(len(outputs))]
        per_token = [token_versions(out["meta_info"], len(ids)) for out, ids in zip(outputs, response_ids)]
        versions = [min(v) if v else weight_version(out["meta_info"]) for v, out in zip(per_token, outputs)]
        return Samples(
            prompt_ids, response_ids, logprobs, torch.tensor(rewards, dtype=torch.float32), texts, versions, per_token,
            parts, finish_reasons=[finish_reason(out["meta_info"]) for out in outputs],
            images=[rows[k // n].images for k in range(len(outputs))] if uris else [],
            routed_experts=self._routed_experts(prompt_ids, response_ids, outputs) if replay else [],
        )  # fmt: skip

    def _routed_experts(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], outputs: list[dict]
    ) -> list[torch.Tensor]:
        """Each sample's ``meta_info["routed_experts"]`` as [tokens - 1, layers, top-k], kept in the
        smallest integer type its expert ids fit (a rollout holds one per token, layer and k)."""
        assert self.routing_shape is not None
        layers, top_k, experts = self.routing_shape
        dtype = torch.uint8 if experts <= 256 else torch.int16
        return [
            torch.from_numpy(routed_experts(out["meta_info"], len(p) + len(r) - 1, layers, top_k).copy()).to(dtype)
            for p, r, out in zip(prompt_ids, response_ids, outputs)
        ]

    def _sample_episodes(
        self,
        rows: list[Row],
        n: int,
        temperature: float,
        max_new_tokens: int,
        seed_tag: object,
        desc: str,
        params: dict[str, Any],
        journal_scope: str | None = None,
    ) -> Samples:
        """``n`` episodes per row, run turn by turn in lockstep: each turn sends every running
        episode's tokens so far (prompt, then the engine's own tokens and the observations'), and
        steps each environment with the engine's text. A turn's requests and seeds depend only on
        the episodes' indices, so a rerun replays every episode exactly."""
        from rlhpc.rollout.episodes import extend_all

        ep = self.episodes
        assert ep is not None
        top_p, total = self.rollout_cfg.top_p, len(rows) * n
        per_request = rows_per_request(len(rows), n, self.num_engines) * n
        progress = self.progress
        bar = progress.add_task(desc, total=total) if progress is not None else None
        loop = asyncio.new_event_loop()  # one per call: async environments keep theirs across turns
        use_journal = self.journal is not None and ep.tools is not None and journal_scope is not None
        journal = self.journal.scope(journal_scope) if use_journal else None
        try:
            seeds = [sample_seed(self.seed, seed_tag, k // n, k % n, "env") for k in range(total)]
            episodes = ep.start_all(self.tokenizer, [(rows[k // n], seeds[k]) for k in range(total)], loop)
            for turn in range(ep.max_turns):
                active = [k for k, e in enumerate(episodes) if not e.done]
                if not active:
                    break
                # an episode's home: the request its turn 0 was in, so its turns go to one engine
                homes = dict.fromkeys(k // per_request for k in active)
                chunks = [[k for k in active if k // per_request == h] for h in homes]
                requests = [
                    Request(
                        input_ids=[episodes[k].input_ids for k in chunk],
                        sampling_params=[
                            {
                                "max_new_tokens": min(
                                    max_new_tokens, ep.max_episode_tokens - len(episodes[k].response_ids)
                                ),
                                "temperature": temperature,
                                "top_p": top_p,
                                # turn 0 with a single-turn sample's seed; later turns their own
                                "sampling_seed": sample_seed(
                                    self.seed, seed_tag, k // n, k % n, *((turn,) if turn else ())
                                ),
                                **params,
                            }
                            for k in chunk
                        ],
                        affinity=home,
                    )
                    for home, chunk in zip(homes, chunks)
                ]
                outputs = [out for answer in self.send(requests, lambda c, answer: None) for out in answer]
                for k, out in zip(active, outputs):
                    ids = list(out["output_ids"])
                    lps = [lp for lp, _tok, _ in out["meta_info"].get("output_token_logprobs", [])]
                    episodes[k].turn = turn
                    episodes[k].add(ids, lps, token_versions(out["meta_info"], len(ids)), generated=True)
                steps = ep.step([episodes[k] for k in active], [out["text"] for out in outputs], loop, journal)
                going, ended = [], []
                for k, out, (observation, reward, done) in zip(active, outputs, steps):
                    episodes[k].reward += reward
                    if done:
                        ended.append(episodes[k])
                    else:
                        going.append((episodes[k], out, observation))
                # the observations' tokens of all the turn's episodes at once (their renders and tails batched)
                extras = extend_all(
                    [e.conversation for e, _, _ in going], [out["output_ids"] for _, out, _ in going],
                    [out["text"] for _, out, _ in going], [observation for _, _, observation in going],
                )  # fmt: skip
                for (e, _, _), extra in zip(going, extras):
                    # no room for the observation and a token more: the episode is cut here
                    if turn + 1 == ep.max_turns or len(e.response_ids) + len(extra) >= ep.max_episode_tokens:
                        e.truncated = True
                        ended.append(e)
                    else:
                        e.add(extra, [], [e.versions[-1] if e.versions else 0] * len(extra), generated=False)
                for e in ended:
                    e.done = True
                    if bar is not None:
                        progress.advance(bar, 1)
        finally:
            loop.close()
            if journal is not None:
                journal.close()
            if bar is not None:
                progress.remove_task(bar)
        decode = self.tokenizer.decode
        texts = {
            "prompt": [decode(e.conversation.prompt_ids) for e in episodes],
            "response": [decode(e.response_ids) for e in episodes],  # the transcript, template tokens and all
            "answer": [rows[k // n].label for k in range(total)],
        }
        parts: dict[str, list[float]] = {}
        if ep.score_replies:  # tools without an environment: data.reward scores the last reply
            # the whole chat: a cut episode's already ends with its last reply and the tools' answers
            chats = [
                e.conversation.messages + ([] if e.truncated else [{"role": "assistant", "content": e.texts[-1]}])
                for e in episodes
            ]
            rewards, parts = self.reward_fn(
                [
                    Sample(
                        prompt=texts["prompt"][k], response=e.texts[-1], label=texts["answer"][k],
                        response_ids=e.response_ids, messages=chats[k], row=rows[k // n],
                        finish_reason="length" if e.truncated else "stop",
                    )
                    for k, e in enumerate(episodes)
                ]
            )  # fmt: skip
            for e, reward in zip(episodes, rewards):
                e.reward = float(reward)
        for e in episodes:
            if e.infra_failed:  # a tool could not run: no reward, masked in training
                e.reward = math.nan
        versions = [min(v) if v else 0 for v in (e.versions for e in episodes)]
        tool_stats = (
            {
                "tool_calls": [float(e.tool_calls) for e in episodes],
                "tool_errors": [float(e.tool_errors) for e in episodes],
                "tool_timeouts": [float(e.tool_timeouts) for e in episodes],
            }
            if ep.tools is not None
            else {}
        )
        return Samples(
            [e.conversation.prompt_ids for e in episodes], [e.response_ids for e in episodes],
            [e.logprobs for e in episodes], torch.tensor([e.reward for e in episodes], dtype=torch.float32), texts,
            versions, [e.versions for e in episodes], parts, [e.loss_mask for e in episodes],
            [e.turns for e in episodes],
            {
                "turns": [float(e.turn + 1) for e in episodes],
                "truncated": [float(e.truncated) for e in episodes],
                "observation_tokens": [float(len(e.loss_mask) - sum(e.loss_mask)) for e in episodes],
                **tool_stats,
            },
        )  # fmt: skip

    def _sample_custom(
        self,
        rows: list[Row],
        n: int,
        temperature: float,
        max_new_tokens: int,
        seed_tag: object,
        desc: str,
        params: dict[str, Any],
    ) -> Samples:
        """``n`` episodes per row of the generate function or agent, all at once; episode k's calls
        go to engine k mod the engine count, call t of it with the seed of turn t of an episode."""
        custom = self.custom
        assert custom is not None
        total = len(rows) * n
        progress = self.progress
        bar = progress.add_task(desc, total=total) if progress is not None else None
        base = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": self.rollout_cfg.top_p, **params}
        try:
            results = run_custom(
                custom, self.tokenizer, self.send, self.num_engines, [rows[k // n] for k in range(total)], base,
                lambda k, t: sample_seed(self.seed, seed_tag, k // n, k % n, *((t,) if t else ())),
                lambda k: sample_seed(self.seed, seed_tag, k // n, k % n, "env"),
                (lambda: progress.advance(bar, 1)) if bar is not None else (lambda: None),
            )  # fmt: skip
        finally:
            if bar is not None:
                progress.remove_task(bar)
        rewards = [r.reward for r in results]
        unscored = [k for k, r in enumerate(rewards) if r is None]
        parts: dict[str, list[float]] = {}
        if unscored:  # data.reward scores the final reply (an agent's: with the whole transcript)
            decode = self.tokenizer.decode
            scored, parts = self.reward_fn(
                [
                    Sample(
                        prompt=decode(results[k].segments[0].prompt_ids), response=results[k].reply,
                        label=rows[k // n].label, response_ids=results[k].segments[-1].response_ids,
                        messages=results[k].messages, row=rows[k // n],
                        finish_reason=results[k].finish,
                    )
                    for k in unscored
                ]
            )  # fmt: skip
            for k, reward in zip(unscored, scored):
                rewards[k] = float(reward)
            parts = {key: [dict(zip(unscored, v)).get(k, math.nan) for k in range(total)] for key, v in parts.items()}
        samples = [(k, seg) for k, r in enumerate(results) for seg in r.segments]
        several = any(len(r.segments) > 1 for r in results)
        decode = self.tokenizer.decode
        texts = {
            "prompt": [decode(seg.prompt_ids) for _, seg in samples],
            "response": [decode(seg.response_ids) for _, seg in samples],  # the transcript, template tokens and all
            "answer": [rows[k // n].label for k, _ in samples],
        }
        return Samples(
            [seg.prompt_ids for _, seg in samples], [seg.response_ids for _, seg in samples],
            [seg.logprobs for _, seg in samples], torch.tensor([rewards[k] for k, _ in samples], dtype=torch.float32),
            texts, [min(seg.versions) if seg.versions else 0 for _, seg in samples], [seg.versions for _, seg in samples],
            {key: [v[k] for k, _ in samples] for key, v in parts.items()}, [seg.loss_mask for _, seg in samples],
            [seg.turns for _, seg in samples],
            {
                "turns": [float(seg.turn + 1) for _, seg in samples],
                # cut: the episode's last reply stopped at its token limit (rollout.overlong_filter masks it)
                "truncated": [float(results[k].finish == "length") for k, _ in samples],
                "observation_tokens": [float(len(seg.loss_mask) - sum(seg.loss_mask)) for _, seg in samples],
            },
            episode_of=[k for k, _ in samples] if several else [],
        )  # fmt: skip

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
