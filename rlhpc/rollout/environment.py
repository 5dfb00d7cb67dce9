"""The environment sampler (``rollout.env`` / ``rollout.tools``): ``n`` episodes per row, run turn
by turn in lockstep (``rlhpc.rollout.episodes`` holds the episode and its environment)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlhpc.data.rows import Row
from rlhpc.rollout.episodes import EpisodeConfig, extend_all
from rlhpc.rollout.journal import ToolJournal
from rlhpc.rollout.sampler import Draw, Sampling, rows_per_request
from rlhpc.rollout.samples import Samples
from rlhpc.rollout.scoring import Sample
from rlhpc.wire.protocol import token_versions
from rlhpc.wire.request import Request, sample_seed

if TYPE_CHECKING:
    from rlhpc.rollout.episodes import Episode


@dataclass
class EnvironmentSampler:
    """Every sample an episode of ``episodes``' environment; ``journal``: the episodes' tool
    answers, recorded and replayed (``rlhpc.rollout.journal``)."""

    run: Sampling
    episodes: EpisodeConfig
    journal: ToolJournal | None = None

    def sample(self, draw: Draw) -> Samples:
        with self.run.bar(draw.desc, len(draw.rows) * draw.n) as advance:
            episodes = self._run(draw, advance)
        return self._samples(draw.rows, draw.n, episodes)

    def _run(self, draw: Draw, advance: Callable[[int], None]) -> list[Episode]:
        """The episodes, run turn by turn in lockstep: each turn sends every running episode's
        tokens so far (prompt, then the engine's own tokens and the observations'), and steps each
        environment with the engine's text. A turn's requests and seeds depend only on the
        episodes' indices, so a rerun replays every episode exactly."""
        run, ep, rows, n = self.run, self.episodes, draw.rows, draw.n
        total = len(rows) * n
        per_request = rows_per_request(len(rows), n, run.num_engines) * n
        loop = asyncio.new_event_loop()  # one per call: async environments keep theirs across turns
        use_journal = self.journal is not None and ep.tools is not None and draw.journal_scope is not None
        journal = self.journal.scope(draw.journal_scope) if use_journal else None
        try:
            seeds = [sample_seed(run.seed, draw.seed_tag, k // n, k % n, "env") for k in range(total)]
            episodes = ep.start_all(run.tokenizer, [(rows[k // n], seeds[k]) for k in range(total)], loop)
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
                                    draw.max_new_tokens, ep.max_episode_tokens - len(episodes[k].response_ids)
                                ),
                                "temperature": draw.temperature,
                                "top_p": run.top_p,
                                # turn 0 with a single-turn sample's seed; later turns their own
                                "sampling_seed": sample_seed(
                                    run.seed, draw.seed_tag, k // n, k % n, *((turn,) if turn else ())
                                ),
                                **draw.params,
                            }
                            for k in chunk
                        ],
                        affinity=home,
                    )
                    for home, chunk in zip(homes, chunks)
                ]
                outputs = [out for answer in run.send(requests, lambda c, answer: None) for out in answer]
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
                    advance(1)
        finally:
            loop.close()
            if journal is not None:
                journal.close()
        return episodes

    def _samples(self, rows: list[Row], n: int, episodes: list[Episode]) -> Samples:
        """The episodes scored (by their environment, or ``data.reward`` on the last reply)."""
        run, ep, total = self.run, self.episodes, len(rows) * n
        decode = run.tokenizer.decode
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
            rewards, parts = run.reward_fn(
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
            prompt_ids=[e.conversation.prompt_ids for e in episodes], response_ids=[e.response_ids for e in episodes],
            logprobs=[e.logprobs for e in episodes],
            rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32), texts=texts,
            weight_versions=versions, token_versions=[e.versions for e in episodes], parts=parts,
            loss_masks=[e.loss_mask for e in episodes], turns=[e.turns for e in episodes],
            episode={
                "turns": [float(e.turn + 1) for e in episodes],
                "truncated": [float(e.truncated) for e in episodes],
                "observation_tokens": [float(len(e.loss_mask) - sum(e.loss_mask)) for e in episodes],
                **tool_stats,
            },
        )  # fmt: skip
