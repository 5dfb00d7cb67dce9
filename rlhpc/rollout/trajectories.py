"""Rollouts written as code: a generate function (``rollout.generate_fn``) or a black-box agent
(``rollout.agent``), both giving the trajectory format episodes give (``docs/guides/multi-turn.md``).

- ``rollout.generate_fn: "module:fn"``, ``async def fn(row, engine) -> Trajectory`` (a plain
  ``def`` runs on a thread of its own): ``engine.generate(input_ids, sampling)`` samples from
  the rollout engines and answers ``Generated`` (tokens, logprobs, weight versions, text). The
  trajectory it returns is checked against the calls it made: every token it trains on (loss
  mask 1) must be a token an engine generated, in the context it was generated in, with the
  engine's logprob.
- ``rollout.agent: "module:fn"``, ``async def fn(row, base_url, api_key) -> float | None``: any
  OpenAI-client code pointed at an endpoint rlhpc serves in front of the engines
  (``rlhpc.rollout.agent_endpoint``). Each call is recorded with its exact token ids, and
  ``assemble`` makes the samples from them.

Every engine call of every episode goes through ``EngineCalls``: the calls made while a batch
is out (and those following within ``GATHER_S``) go out together through the run's ``Send``
(the engine pool: restarts and resends on engine death, stop requests), an episode's calls to
one engine where the pool has several, each call with its own seed (run seed, rollout, sample,
call number).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlhpc.errors import ConfigError, RlhpcError
from rlhpc.rollout.tools import warn_special_tags
from rlhpc.util.imports import import_function

if TYPE_CHECKING:
    from rlhpc.config import Config
    from rlhpc.wire.request import Send

log = logging.getLogger(__name__)

GENERATE_FN_SIGNATURE = "(row, engine) -> Trajectory, async def or def (rlhpc.rollout.trajectories)"
GATHER_S = 0.02  # a batch of engine calls takes those that arrive within this of the one before (s)
AGENT_SIGNATURE = "async def fn(row, base_url, api_key) -> float | None, using the OpenAI client"


@dataclass(frozen=True)
class Generated:
    """One engine answer: the sampled ``tokens`` (the stop token included), each one's
    ``logprobs`` and ``weight_versions``, the detokenized ``text`` and the ``finish_reason``
    ("stop", "length" or "abort"; ``matched``: the stop token id or string that ended it)."""

    tokens: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    text: str
    finish_reason: str | None = None
    matched: int | str | None = None


@dataclass
class Trajectory:
    """What a generate function returns: ``prompt_ids`` then ``response_ids``, with per response
    token ``loss_mask`` (1: an engine's token, trained on; 0: anything else) and ``logprobs``
    (the engine's for mask 1, anything for mask 0). ``reward`` None: ``data.reward`` scores it."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reward: float | None = None


@dataclass(frozen=True)
class Call:
    """One engine call as it was made: its prompt and the engine's answer."""

    prompt_ids: list[int]
    output: Generated


class Growing:
    """A response that grows by generated tokens (trained, with their logprobs) and observation
    tokens (masked out): an environment's episode (``rlhpc.rollout.episodes.Episode``) and an
    assembled sample (``Segment``) alike. The dataclass that takes it on holds the fields."""

    response_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    turns: list[int]
    versions: list[int]
    turn: int

    def add(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], generated: bool) -> None:
        self.response_ids += ids
        self.logprobs += logprobs if generated else [0.0] * len(ids)
        self.loss_mask += [int(generated)] * len(ids)
        self.turns += [max(self.turn, 0)] * len(ids)  # a segment's tokens before its first call's are turn 0
        self.versions += versions


@dataclass
class Segment(Growing):
    """One trained sample assembled from calls: the first call's prompt, then the response."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    turn: int = -1

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def assemble(calls: Sequence[Call]) -> list[Segment]:
    """The samples of an agent's calls, in call order: a call whose prompt extends the current
    sample token for token (its prompt and every output so far) joins it, the tokens between as
    mask 0; any other call starts a new sample with its prompt."""
    segments: list[Segment] = []
    for call in calls:
        current = segments[-1] if segments else None
        if current is None or call.prompt_ids[: len(current.ids)] != current.ids:
            current = Segment(list(call.prompt_ids))
            segments.append(current)
        gap = call.prompt_ids[len(current.ids) :]
        current.add(gap, [], [current.versions[-1] if current.versions else 0] * len(gap), False)
        current.turn += 1
        out = call.output
        current.add(out.tokens, out.logprobs, out.weight_versions, True)
    return segments


class TrajectoryRefused(RlhpcError):
    """A generate function returned a trajectory rlhpc will not train on."""


def check_trajectory(spec: str, traj: Any, calls: Sequence[Call]) -> Segment:
    """``traj`` as a ``Segment``, if it is one rlhpc can train on: its lists agree in length, its
    mask is 0/1, and each run of mask-1 tokens is a piece of one call's output, in that call's
    context (the tokens before it are the call's prompt and the output before the piece), with
    the engine's logprobs. Otherwise ``TrajectoryRefused`` naming the function and the fault."""

    def refuse(what: str, fix: str) -> TrajectoryRefused:
        return TrajectoryRefused(f"rollout.generate_fn {spec} returned a trajectory {what}", fix)

    if not isinstance(traj, Trajectory):
        raise refuse(
            f"that is a {type(traj).__name__}, not a Trajectory", "return rlhpc.rollout.trajectories.Trajectory(...)"
        )
    if any(m not in (0, 1) for m in traj.loss_mask):
        raise refuse("with a loss_mask entry other than 0 or 1", "mark engine tokens 1 and every other token 0")
    try:  # numpy or torch values as plain ints and floats, compared and stored as the engine's are
        prompt, response = [int(t) for t in traj.prompt_ids], [int(t) for t in traj.response_ids]
        mask, logprobs = [int(m) for m in traj.loss_mask], [float(lp) for lp in traj.logprobs]
    except (TypeError, ValueError) as e:
        raise refuse(f"with a value that is not a number: {e}", "give token ids as ints, logprobs as floats") from e
    n = len(response)
    if len(mask) != n or len(logprobs) != n:
        raise refuse(
            f"whose lists differ in length: {n} response_ids, {len(mask)} loss_mask, {len(logprobs)} logprobs",
            "give one loss_mask entry and one logprob per response token",
        )
    if not prompt:
        raise refuse("with no prompt_ids", "give the tokens of the first engine call's prompt")
    full = prompt + response
    seg = Segment(list(prompt))
    pos = 0
    while pos < n:
        if mask[pos] == 0:
            seg.add([response[pos]], [], [seg.versions[-1] if seg.versions else 0], False)
            pos += 1
            continue
        end = pos
        while end < n and mask[end] == 1:
            end += 1
        # the run may hold several calls' outputs back to back (a call continuing a cut one)
        piece = _engine_piece(full, len(prompt) + pos, len(prompt) + end, logprobs[pos:end], calls)
        if piece is None:
            raise refuse(
                f"whose response tokens {pos}..{end - 1} (loss mask 1) are not what an engine generated in "
                "that context, or not with the logprobs it reported",
                "mark 1 only tokens engine.generate returned, after exactly the input_ids it was given and "
                "the tokens it returned before them, with the logprobs it returned; mark any other token 0",
            )
        seg.turn += 1
        seg.add(response[pos : pos + len(piece)], logprobs[pos : pos + len(piece)], piece, True)
        pos += len(piece)
    return seg


def _engine_piece(
    full: list[int], start: int, end: int, logprobs: Sequence[float], calls: Sequence[Call]
) -> list[int] | None:
    """The weight versions of the longest ``full[start:k]`` (k <= ``end``) that one call generated,
    with those logprobs, right after everything before it (the call's prompt and its own earlier
    output: the context the trainer recomputes the logprobs in); None if no call did."""
    best: list[int] | None = None
    for call in calls:
        out, o = call.output, start - len(call.prompt_ids)  # where the piece would begin in the output
        if o < 0 or o >= len(out.tokens) or full[:start] != call.prompt_ids + out.tokens[:o]:
            continue
        k = 0
        while (
            start + k < end
            and o + k < len(out.tokens)
            and full[start + k] == out.tokens[o + k]
            and logprobs[k] == out.logprobs[o + k]
        ):
            k += 1
        if k and (best is None or k > len(best)):
            best = out.weight_versions[o : o + k]
    return best


# ------------------------------------------------------------------ engine calls


def generated(out: dict) -> Generated:
    """An SGLang /generate output as ``Generated``."""
    from rlhpc.wire.protocol import MetaInfo, finish_reason, token_versions

    ids = [int(t) for t in out["output_ids"]]
    meta = out["meta_info"]
    reason = meta.get(MetaInfo.FINISH_REASON)
    return Generated(
        ids,
        [float(lp) for lp, _tok, _ in meta.get(MetaInfo.OUTPUT_TOKEN_LOGPROBS, [])],
        token_versions(meta, len(ids)),
        out["text"],
        finish_reason(meta),
        reason.get("matched") if isinstance(reason, dict) else None,
    )


class EngineCalls:
    """Every episode's engine calls, sent from the thread that runs ``run``: the episodes run on
    an event loop of a thread of their own (and the agent endpoint on another), and the calls
    made while a batch is out (and within ``GATHER_S`` of each other) are the next batch. Sends
    stay on the caller's thread, where the engine pool expects them (its restart rules are per
    thread)."""

    def __init__(self, send: Send, num_engines: int):
        self.send, self.num_engines = send, max(1, num_engines)
        self._queue: queue.Queue[tuple[list[int], dict, int, Future] | None] = queue.Queue()
        self._failed: BaseException | None = None  # a send that failed fails every later call at once

    def submit(self, input_ids: Sequence[int], params: dict, engine: int) -> Future:
        """Queue one call (any thread); the future gets the engine's output dict."""
        fut: Future = Future()
        if self._failed is not None:
            _settle(fut, error=self._failed)
        else:
            self._queue.put(([int(t) for t in input_ids], params, engine % self.num_engines, fut))
        return fut

    def run(self, main: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``main()`` on a new event loop in a thread, sending its calls from this one until it
        ends; its result, or the error of a failed send (an abort, engines down), or its own."""
        result: Future = Future()

        def episodes() -> None:
            try:
                result.set_result(asyncio.run(main()))
            except BaseException as e:  # handed to the caller's thread
                result.set_exception(e)
            finally:
                self._queue.put(None)

        thread = threading.Thread(target=episodes, name="rlhpc-episodes", daemon=True)
        thread.start()
        ended = False
        while not ended:
            batch = [self._queue.get()]
            # the other episodes' calls usually follow within a moment (their previous answers
            # arrived together): they join this batch rather than wait for it to return
            while batch[-1] is not None:
                try:
                    batch.append(self._queue.get(timeout=GATHER_S))
                except queue.Empty:
                    break
            ended = None in batch
            self._dispatch([b for b in batch if b is not None])
        thread.join()
        if self._failed is not None:
            raise self._failed
        return result.result()

    def _dispatch(self, batch: list[tuple[list[int], dict, int, Future]]) -> None:
        from rlhpc.wire.request import Request

        if not batch:
            return
        if self._failed is not None:
            for *_, fut in batch:
                _settle(fut, error=self._failed)
            return
        by_engine: dict[int, list[tuple[list[int], dict, int, Future]]] = {}
        for b in batch:
            by_engine.setdefault(b[2], []).append(b)
        groups = list(by_engine.values())
        requests = [Request([ids for ids, *_ in g], [p for _, p, *_ in g], affinity=g[0][2]) for g in groups]
        try:
            answers = self.send(requests, lambda c, answer: None)
        except BaseException as e:
            self._failed = e
            for *_, fut in batch:
                _settle(fut, error=e)
            return
        for g, answer in zip(groups, answers):
            for (*_, fut), out in zip(g, answer):
                _settle(fut, out)


def _settle(fut: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Answer ``fut`` unless its episode was cancelled meanwhile (another one failed)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


class EngineHandle:
    """One episode's way to the engines: what a generate function gets as ``engine``, and what
    the agent endpoint calls for the episode's requests. Every call is recorded (``calls``)."""

    def __init__(self, calls: EngineCalls, engine: int, params: dict, seed: Callable[[int], int], tokenizer: Any):
        self.tokenizer = tokenizer  # the run's, for prompts and chat templates
        self.params = dict(params)  # the run's sampling: max_new_tokens, temperature, top_p, ...
        self._calls, self._engine, self._seed = calls, engine, seed
        self._made: dict[int, Call] = {}
        self._next = 0

    @property
    def calls(self) -> list[Call]:
        """The calls answered so far, in the order they were made."""
        return [self._made[i] for i in sorted(self._made)]

    def submit(self, input_ids: Sequence[int], sampling: dict | None = None) -> tuple[int, Future]:
        number, self._next = self._next, self._next + 1
        params = {**self.params, **(sampling or {}), "sampling_seed": self._seed(number)}
        return number, self._calls.submit(input_ids, params, self._engine)

    def record(self, number: int, input_ids: Sequence[int], out: dict) -> Generated:
        g = generated(out)
        self._made[number] = Call([int(t) for t in input_ids], g)
        return g

    def generate(self, input_ids: Sequence[int], sampling: dict | None = None) -> Any:
        """Sample after ``input_ids`` with the run's sampling (``sampling``: SGLang sampling params
        that override it, e.g. ``{"max_new_tokens": 64, "stop": ["\\n"]}``): ``await`` it in an
        ``async def``; called from a plain ``def`` it blocks and returns the ``Generated``."""
        number, fut = self.submit(input_ids, sampling)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a plain def generate function, on its own thread
            return self.record(number, input_ids, fut.result())

        async def answer() -> Generated:
            return self.record(number, input_ids, await asyncio.wrap_future(fut))

        return answer()


def resolve_generate_fn(spec: str, key: str = "rollout.generate_fn") -> Callable:
    fn = import_function(key, spec, GENERATE_FN_SIGNATURE)
    if inspect.isclass(fn):
        raise ConfigError(f"{key} = {spec!r} is a class", f"point it at a function {GENERATE_FN_SIGNATURE}")
    return fn


def resolve_agent(spec: str, key: str = "rollout.agent") -> Callable:
    fn = import_function(key, spec, AGENT_SIGNATURE)
    if inspect.isclass(fn):
        raise ConfigError(f"{key} = {spec!r} is a class", f"point it at an {AGENT_SIGNATURE}")
    try:
        inspect.signature(fn).bind(None, None, None)
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"{key} = {spec!r} does not take (row, base_url, api_key): {e}", f"make it an {AGENT_SIGNATURE}"
        ) from e
    return fn


def check_custom(cfg: Config, env: str | None) -> None:
    """A run with a generate function or an agent: one way in only, importable."""
    r = cfg.rollout
    if r.generate_fn is not None and r.agent is not None:
        raise ConfigError(
            f"rollout.generate_fn = {r.generate_fn} and rollout.agent = {r.agent} are both set: a run has one way in",
            "keep one of them (docs/guides/multi-turn.md#three-ways-in says which fits)",
        )
    key, spec = ("rollout.generate_fn", r.generate_fn) if r.generate_fn is not None else ("rollout.agent", r.agent)
    if env is not None or r.tools:
        other = (
            f"rollout.env = {env}"
            if r.env
            else f"data.task = {cfg.data.task}'s environment"
            if env
            else "rollout.tools"
        )
        raise ConfigError(
            f"{key} = {spec} with {other}: the {key.removeprefix('rollout.')} runs the whole rollout, the "
            "environment and tools would never be used",
            f"unset {other.split(' ')[0]} (an agent passes its own tools in its requests), or unset {key}",
        )
    if r.generate_fn is not None:
        resolve_generate_fn(r.generate_fn)
        return
    resolve_agent(spec)  # no chat template needed: without one, the agent's endpoint serves /v1/completions
    warn_special_tags(cfg.model.path, f"rollout.agent = {spec}")
