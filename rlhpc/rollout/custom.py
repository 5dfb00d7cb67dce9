"""A run's generate function or agent (``rollout.generate_fn`` / ``rollout.agent``): made from the
config once, then run for the rows of each rollout, one episode per row, all at once
(``docs/guides/multi-turn.md``). The trajectory format and the engine calls they make:
``rlhpc.rollout.trajectories``; the agent's OpenAI endpoint: ``rlhpc.rollout.agent_endpoint``."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlhpc.config import context_len
from rlhpc.data.prompts import conversation_template
from rlhpc.data.rows import Row, describe
from rlhpc.errors import RlhpcError, user_code_error
from rlhpc.rollout.sampler import Draw, Sampling
from rlhpc.rollout.samples import Samples
from rlhpc.rollout.scoring import Sample
from rlhpc.rollout.tools import resolve_parser
from rlhpc.rollout.trajectories import (
    EngineCalls,
    EngineHandle,
    Segment,
    assemble,
    check_trajectory,
    resolve_agent,
    resolve_generate_fn,
)
from rlhpc.wire.request import GenerationAborted, Send, sample_seed


@dataclass(frozen=True)
class CustomRollout:
    """A run's generate function or agent (``make_custom``)."""

    kind: Literal["generate_fn", "agent"]
    spec: str
    fn: Callable
    template: str | None = None  # the agent's chat template (data.chat_template; None: none, completions only)
    template_name: str = ""
    parser: Callable[[str], Any] | None = None  # the agent's tool-call parser (rollout.tool_parser)
    context_len: int | None = None  # the model's, for the agent endpoint's checks (None: unknown)

    @property
    def key(self) -> str:
        return f"rollout.{self.kind}"


@dataclass
class EpisodeResult:
    """One episode's samples and what scores it."""

    segments: list[Segment]
    reward: float | None
    reply: str  # the last engine call's text
    finish: str | None  # its finish reason
    messages: list[dict] | None = None  # the agent's final transcript


def make_custom(cfg: Any, tokenizer: Any) -> CustomRollout | None:
    """The run's generate function or agent from its ``Config``; None with neither."""
    r = cfg.rollout
    if r.generate_fn is not None:
        return CustomRollout("generate_fn", r.generate_fn, resolve_generate_fn(r.generate_fn))
    if r.agent is None:
        return None
    template, name = agent_template(cfg.data, tokenizer)
    parser = resolve_parser(r.tool_parser)
    return CustomRollout("agent", r.agent, resolve_agent(r.agent), template, name, parser, context_len(cfg))


def agent_template(data: Any, tokenizer: Any) -> tuple[str | None, str]:
    """(template, its name) an agent's chat messages are rendered with; None where the run has
    none (``data.chat_template: none``, or ``auto`` and a tokenizer without one): the endpoint then
    serves completions only."""
    if data.chat_template == "none" or (data.chat_template == "auto" and not getattr(tokenizer, "chat_template", None)):
        return None, ""
    return conversation_template(data, tokenizer, "rollout.agent")


async def _call_user(fn: Callable, *args: Any) -> Any:
    """``fn(*args)``: awaited when it is a coroutine function, else on a thread of its own (a
    blocking ``def`` must not stall the other episodes)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await asyncio.to_thread(fn, *args)


def run_custom(
    custom: CustomRollout,
    tokenizer: Any,
    send: Send,
    num_engines: int,
    rows: Sequence[Row],
    params: dict,
    call_seed: Callable[[int, int], int],
    episode_seed: Callable[[int], int],
    episode_done: Callable[[], None] = lambda: None,
) -> list[EpisodeResult]:
    """Run one episode per row of ``rows`` (a row per sample), all at once; each episode's
    calls go to engine ``k mod num_engines``, call t with seed ``call_seed(k, t)``."""
    calls = EngineCalls(send, num_engines)
    handles = [EngineHandle(calls, k, params, lambda t, k=k: call_seed(k, t), tokenizer) for k in range(len(rows))]
    user_rows = [row.with_seed(episode_seed(k)) for k, row in enumerate(rows)]

    async def user(k: int, *args: Any) -> Any:
        try:
            return await _call_user(custom.fn, user_rows[k], *args)
        except (RlhpcError, GenerationAborted):
            raise
        except Exception as e:  # the user's code: named, with its traceback chained
            raise user_code_error(f"{custom.key} {custom.spec}", e, f"the episode of {describe(user_rows[k])}") from e

    async def generate_fn(k: int) -> EpisodeResult:
        traj = await user(k, handles[k])
        made = handles[k].calls
        segment = check_trajectory(custom.spec, traj, made)
        reward = None if traj.reward is None else float(traj.reward)
        last = made[-1].output if made else None
        episode_done()
        return EpisodeResult([segment], reward, last.text if last else "", last.finish_reason if last else None)

    async def agent(k: int, endpoint: Any) -> EpisodeResult:
        key = endpoint.open(handles[k])
        try:
            reward = await user(k, endpoint.base_url, key)
        finally:
            transcript = endpoint.close(key)
        made = handles[k].calls
        if not made:
            raise RlhpcError(
                f"rollout.agent {custom.spec} made no call to the endpoint it was given ({endpoint.base_url})",
                "point the OpenAI client at base_url with api_key, e.g. AsyncOpenAI(base_url=base_url, api_key=api_key)",
            )
        if reward is not None and not isinstance(reward, int | float):
            raise RlhpcError(
                f"rollout.agent {custom.spec} returned {str(reward)[:200]}, not a reward",
                "return a float, or None to have data.reward score the final transcript",
            )
        episode_done()
        last = made[-1].output
        return EpisodeResult(
            assemble(made), None if reward is None else float(reward), last.text, last.finish_reason, transcript
        )

    async def main() -> list[EpisodeResult]:
        if custom.kind == "generate_fn":
            return list(await asyncio.gather(*(generate_fn(k) for k in range(len(rows)))))
        # late: only an agent run needs the HTTP server (uvicorn, fastapi) in the driver
        from rlhpc.rollout.agent_endpoint import AgentEndpoint, limits_for

        with AgentEndpoint(
            tokenizer, custom.template, custom.template_name, custom.parser, custom.context_len,
            limits=limits_for(len(rows)),
        ) as endpoint:  # fmt: skip
            return list(await asyncio.gather(*(agent(k, endpoint) for k in range(len(rows)))))

    return calls.run(main)


@dataclass
class CustomSampler:
    """Every sample from the run's generate function or agent: ``n`` episodes per row, all at
    once; episode k's calls go to engine k mod the engine count, call t of it with the seed of turn
    t of an episode (``rlhpc.rollout.sampler``)."""

    run: Sampling
    custom: CustomRollout

    def sample(self, draw: Draw) -> Samples:
        run, custom, rows, n, tag = self.run, self.custom, draw.rows, draw.n, draw.seed_tag
        total = len(rows) * n
        base = {"max_new_tokens": draw.max_new_tokens, "temperature": draw.temperature, "top_p": run.top_p}
        base.update(draw.params)
        with run.bar(draw.desc, total) as advance:
            results = run_custom(
                custom, run.tokenizer, run.send, run.num_engines, [rows[k // n] for k in range(total)], base,
                lambda k, t: sample_seed(run.seed, tag, k // n, k % n, *((t,) if t else ())),
                lambda k: sample_seed(run.seed, tag, k // n, k % n, "env"),
                lambda: advance(1),
            )  # fmt: skip
        rewards = [r.reward for r in results]
        unscored = [k for k, r in enumerate(rewards) if r is None]
        parts: dict[str, list[float]] = {}
        if unscored:  # data.reward scores the final reply (an agent's: with the whole transcript)
            decode = run.tokenizer.decode
            scored, parts = run.reward_fn(
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
        decode = run.tokenizer.decode
        texts = {
            "prompt": [decode(seg.prompt_ids) for _, seg in samples],
            "response": [decode(seg.response_ids) for _, seg in samples],  # the transcript, template tokens and all
            "answer": [rows[k // n].label for k, _ in samples],
        }
        return Samples(
            prompt_ids=[seg.prompt_ids for _, seg in samples], response_ids=[seg.response_ids for _, seg in samples],
            logprobs=[seg.logprobs for _, seg in samples],
            rewards=torch.tensor([rewards[k] for k, _ in samples], dtype=torch.float32), texts=texts,
            weight_versions=[min(seg.versions) if seg.versions else 0 for _, seg in samples],
            token_versions=[seg.versions for _, seg in samples],
            parts={key: [v[k] for k, _ in samples] for key, v in parts.items()},
            loss_masks=[seg.loss_mask for _, seg in samples], turns=[seg.turns for _, seg in samples],
            episode={
                "turns": [float(seg.turn + 1) for _, seg in samples],
                # cut: the episode's last reply stopped at its token limit (rollout.overlong_filter masks it)
                "truncated": [float(results[k].finish == "length") for k, _ in samples],
                "observation_tokens": [float(len(seg.loss_mask) - sum(seg.loss_mask)) for _, seg in samples],
            },
            episode_of=[k for k, _ in samples] if several else [],
        )  # fmt: skip
