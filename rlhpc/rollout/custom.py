"""A run's generate function or agent (``rollout.generate_fn`` / ``rollout.agent``): made from the
config once, then run for the rows of each rollout, one episode per row, all at once
(``docs/guides/multi-turn.md``). The trajectory format and the engine calls they make:
``rlhpc.rollout.trajectories``; the agent's OpenAI endpoint: ``rlhpc.rollout.agent_endpoint``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rlhpc.config import context_len
from rlhpc.data.prompts import conversation_template
from rlhpc.data.rows import Row, describe
from rlhpc.errors import RlhpcError, user_code_error
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
from rlhpc.wire.request import GenerationAborted, Send


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
