"""Scoring samples with the user's reward, on the driver.

A reward is one of three forms, told apart by its signature (``reward_form``):

- ``reward(sample: Sample) -> float | dict``: everything about the sample (prompt text and chat
  messages, response text and ids, label, the data row as the file has it, finish reason);
- ``reward(prompt, response, answer) -> float | dict``: the older form, unchanged;
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, told by
  its parameter names and called with them: the row's ``data_source`` and ``extra_info``
  columns, the response, the label. (verl's per-dataset ``compute_score(solution_str,
  ground_truth)`` is the same form without the row's columns.)

A dict reward (``{"score": 1.0, "format": 0.5}``) trains on ``score`` and logs every part as
``reward/<part>``. A reward that raises is one error naming the function, the sample and
where it raised, which stops the job for good (``UserCodeError``: the same code would fail the
same way after a restart); with ``data.reward_errors: zero`` the sample scores 0 instead and is
counted (``reward/errors``). A grader elsewhere (a URL) that fails is an outside service's
fault: ``RewardError``, which the job requeues on like a crash. A reward that raises (or, batched,
returns) ``rlhpc.errors.InfrastructureFailure`` leaves its sample unscored (NaN), which training
masks: a sandbox that could not run is no verdict on the response.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import multiprocessing
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlhpc.errors import ConfigError, InfrastructureFailure, RlhpcError, user_code_error

if TYPE_CHECKING:
    from rlhpc.config import DataConfig
    from rlhpc.schedule import BusyClock

SIGNATURES = (
    "reward(sample), reward(prompt, response, answer), or verl's compute_score(data_source, solution_str, "
    "ground_truth, extra_info=None), returning a float or a dict with 'score'"
)
VERL_NAMES = ("solution_str", "ground_truth")  # verl's reward parameters: the form is told by them
RewardForm = Literal["sample", "prompt", "verl"]


class RewardError(RlhpcError):
    # A grader elsewhere (data.reward: a URL) may fail for a moment: the job requeues on it as on
    # a crash (checkpoint.requeue_on_failure), and a grader failing every time ends held.
    transient = True


@dataclass(frozen=True)
class Sample:
    """One generated response as a reward sees it."""

    prompt: str  # the text the model was given (a chat prompt: as its template rendered it)
    response: str
    label: str
    response_ids: list[int] = field(default_factory=list)
    messages: list[dict] | None = None  # a chat prompt's messages
    row: dict = field(default_factory=dict)  # the data row as the file has it (rlhpc.data.rows.Row)
    finish_reason: str | None = None  # "stop", "length" or "abort"

    @property
    def answer(self) -> str:  # the older form's name for the label
        return self.label

    @property
    def metadata(self) -> dict:  # the older name of the row
        return self.row

    @property
    def response_length(self) -> int:
        return len(self.response_ids)


def is_batched(fn: Callable) -> bool:
    """A reward of the whole list of samples: an ``async def`` one, or one marked ``@batched``."""
    return inspect.iscoroutinefunction(fn) or getattr(fn, "rlhpc_batched", False)


def batched(fn: Callable) -> Callable:
    """Mark ``fn(samples: list[Sample]) -> list[float | dict]`` as scoring a whole batch at once
    (a model-based grader, a sandbox that runs many at once); an ``async def`` one needs no mark."""
    fn.rlhpc_batched = True  # type: ignore[attr-defined]
    return fn


def reward_form(fn: Callable, spec: str) -> RewardForm:
    """Which form ``fn`` is (module doc); a signature of none of them is refused, naming them."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: assume the older form
        return "prompt"
    names = {p.name for p in params}
    if all(n in names for n in VERL_NAMES):
        return "verl"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(required) == 1 and len(positional) < 3 and not varargs:
        return "sample"
    if len(required) <= 3 and (len(positional) >= 3 or varargs):
        return "prompt"
    said = ", ".join(p.name for p in params) or "no arguments"
    raise ConfigError(
        f"data.reward = {spec!r} takes ({said}), which is none of the reward forms", f"write {SIGNATURES}"
    )


def takes_sample(fn: Callable, spec: str) -> bool:
    """True for ``reward(sample)``; a signature of no form is an error (``reward_form``)."""
    return reward_form(fn, spec) == "sample"


def call_reward(fn: Callable, form: RewardForm, s: Sample) -> Any:
    """``fn`` (a reward of ``form``) on one sample."""
    if form == "sample":
        return fn(s)
    if form == "prompt":
        return fn(s.prompt, s.response, s.label)
    return fn(**_verl_arguments(fn, s))


def _verl_arguments(fn: Callable, s: Sample) -> dict[str, Any]:
    """verl's keyword arguments of one sample, those ``fn`` takes: the row's ``data_source`` and
    ``extra_info`` columns (None where the file has none), the response, the label."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    given = {
        "data_source": s.row.get("data_source"),
        "solution_str": s.response,
        "ground_truth": s.label,
        "extra_info": s.row.get("extra_info"),
    }
    return {k: v for k, v in given.items() if k in params or takes_any}


def is_remote(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def check_reward(data: DataConfig) -> None:
    """data.reward, at submit: a remote grader's key file exists; a function of your own imports,
    takes one of the two forms, and (a batched one) runs as one call."""
    if data.reward is not None and is_remote(data.reward):
        if data.reward_key_file is not None and not Path(data.reward_key_file).is_file():
            raise ConfigError(
                f"data.reward_key_file {data.reward_key_file} does not exist",
                "write the remote grader's key to that file (chmod 600), or unset data.reward_key_file",
            )
    elif data.reward is not None:
        fn = _import_reward(data.reward)
        if not is_batched(fn):
            reward_form(fn, data.reward)  # one of the forms, or the signature is refused
        elif data.reward_workers:
            raise ConfigError(
                f"data.reward {data.reward} scores whole batches, which data.reward_workers does not split over processes",
                "set data.reward_workers: 0 (a batched reward runs as one call), or score one sample per call",
            )


class RemoteReward:
    """A grader that lives elsewhere: ``data.reward: http://host:port/path``. Each sample is one
    POST of its fields as JSON (``prompt``, ``messages``, ``response``, ``response_ids``,
    ``label``, ``row``, ``metadata`` (the row again, its older name), ``finish_reason``); the
    answer is a number or a dict with ``score``
    (a dict reward). Each call is bounded by ``timeout_s`` and not retried past it; a refused
    connection or a 5xx is retried ``retries`` times with backoff; ``concurrency`` calls run at once. The key,
    if any, is read from a file and sent as ``Authorization: Bearer``, never logged."""

    def __init__(self, url: str, timeout_s: float, concurrency: int, key_file: str | None = None, retries: int = 3):
        import urllib3

        self.url, self.timeout_s, self.concurrency = url, timeout_s, concurrency
        self.headers = {"Content-Type": "application/json"}
        if key_file is not None:
            self.headers["Authorization"] = f"Bearer {Path(key_file).read_text().strip()}"
        # A refused connection or a 5xx is retried; a call past its limit is not (a hung grader
        # does not answer sooner, and retrying would multiply the limit).
        retry = urllib3.Retry(
            total=retries, read=0, backoff_factor=0.5, status_forcelist=(500, 502, 503, 504), allowed_methods=None
        )
        self.http = urllib3.PoolManager(maxsize=concurrency, retries=retry, timeout=urllib3.Timeout(total=timeout_s))

    def __call__(self, sample: Sample) -> float | dict:
        body = {
            "prompt": sample.prompt, "messages": sample.messages, "response": sample.response,
            "response_ids": sample.response_ids, "label": sample.label, "row": sample.row,
            "metadata": sample.row, "finish_reason": sample.finish_reason,
        }  # fmt: skip
        resp = self.http.request("POST", self.url, body=json.dumps(body, default=str), headers=self.headers)
        if resp.status != 200:
            raise OSError(f"{self.url} answered HTTP {resp.status}: {resp.data[:200].decode(errors='replace')}")
        return json.loads(resp.data)


class PooledReward:
    """A local grader run in ``workers`` processes of its own (``data.reward_workers``): CPU-heavy
    grading leaves the driver's GIL alone, and a call that outlives ``timeout_s`` is cut by
    ending its process (a thread cannot be stopped), then the pool is started again. Each worker
    imports the function by its spec, as the driver does."""

    def __init__(self, spec: str, workers: int, timeout_s: float):
        self.spec, self.workers, self.timeout_s = spec, workers, timeout_s
        self.form = reward_form(_import_reward(spec), spec)
        self._pool = None

    def _start(self):
        # spawn: the driver has threads (Ray's, the schedule's), which a fork would copy half-held
        self._pool = multiprocessing.get_context("spawn").Pool(
            self.workers, initializer=_worker_init, initargs=(self.spec,)
        )
        return self._pool

    def map(self, samples: list[Sample]) -> list[tuple[Any, BaseException | None]]:
        """(value, error) per sample, in order; a call past its limit is a TimeoutError."""
        out: list[tuple[Any, BaseException | None]] = []
        while len(out) < len(samples):
            pool = self._pool or self._start()
            rest = samples[len(out) :]
            pending = [pool.apply_async(_worker_call, (s, self.form)) for s in rest]
            for r in pending:
                try:
                    out.append((r.get(self.timeout_s), None))
                except multiprocessing.TimeoutError:
                    out.append((None, TimeoutError(f"no answer within data.reward_timeout_s = {self.timeout_s:g} s")))
                    self.close()  # ends the hung call; what was queued behind it is sent again
                    break
                except Exception as e:
                    out.append((None, e))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


def _import_reward(spec: str) -> Callable:
    from rlhpc.data.tasks import resolve_reward

    return resolve_reward(spec)


_WORKER_FN: Callable | None = None


def _worker_init(spec: str) -> None:
    global _WORKER_FN
    _WORKER_FN = _import_reward(spec)


def _worker_call(s: Sample, form: RewardForm) -> Any:
    assert _WORKER_FN is not None
    return call_reward(_WORKER_FN, form, s)


class Scorer:
    """Score a list of samples: (scores, parts) where parts maps each dict part (and ``errors``
    where rewards may fail) to one value per sample."""

    def __init__(self, fn: Callable | PooledReward, spec: str, errors: str = "raise"):
        self.fn, self.spec, self.errors = fn, spec, errors
        self.batched = not isinstance(fn, PooledReward | RemoteReward) and is_batched(fn)
        self.form: RewardForm
        if isinstance(fn, PooledReward):
            self.form = fn.form
        elif isinstance(fn, RemoteReward) or self.batched:
            self.form = "sample"
        else:
            self.form = reward_form(fn, spec)
        self.concurrency = fn.concurrency if isinstance(fn, RemoteReward) else 1

    def _call(self, s: Sample) -> tuple[Any, BaseException | None]:
        try:
            return call_reward(self.fn, self.form, s), None
        except RlhpcError:
            raise
        except Exception as e:
            return None, e

    def _one(self, s: Sample, value: Any, error: BaseException | None) -> tuple[float, dict[str, float], float]:
        """(score, other parts, 1.0 if the reward failed). A sample whose reward could not be
        known for an infrastructure reason (``InfrastructureFailure`` raised, or returned by a
        batched reward) scores NaN: no reward, masked out of training (``Generation.rollout``)."""
        if isinstance(error, InfrastructureFailure) or isinstance(value, InfrastructureFailure):
            return math.nan, {}, 0.0
        if error is None:
            try:
                return (*self._read(value), 0.0)
            except (TypeError, ValueError) as e:  # a value that is no number: the reward's bug
                error = e
        if self.errors != "zero":
            fix = "fix the reward, or set data.reward_errors: zero to score such samples 0 and count them"
            on = f"the sample with prompt {s.prompt[-80:]!r}, label {s.label[:40]!r} and response {s.response[:80]!r}"
            if isinstance(self.fn, RemoteReward):  # an outside service: the job may requeue on it
                raise RewardError(
                    f"the reward {self.spec} raised {type(error).__name__}: {error} on {on}", fix
                ) from error
            raise user_code_error(f"the reward {self.spec}", error, on, fix)
        return 0.0, {}, 1.0

    def _batch(self, samples: list[Sample]) -> list[tuple[Any, BaseException | None]]:
        try:
            values = asyncio.run(self.fn(samples)) if inspect.iscoroutinefunction(self.fn) else self.fn(samples)
            values = list(values)
        except Exception as e:
            return [(None, e)] * len(samples)
        if len(values) != len(samples):
            raise RlhpcError(
                f"the batched reward {self.spec} returned {len(values)} values for {len(samples)} samples",
                "return one float or dict per sample, in order",
            )
        return [(v, None) for v in values]

    def __call__(self, samples: list[Sample]) -> tuple[list[float], dict[str, list[float]]]:
        if not samples:
            return [], {}
        if isinstance(self.fn, PooledReward):  # in processes of its own, each call bounded
            called = self.fn.map(samples)
        elif self.batched:
            called = self._batch(samples)
        elif self.concurrency > 1 and len(samples) > 1:  # a remote grader: its calls wait on the network
            with ThreadPoolExecutor(min(self.concurrency, len(samples)), thread_name_prefix="reward") as pool:
                called = list(pool.map(self._call, samples))
        else:
            called = [self._call(s) for s in samples]
        results = [self._one(s, value, error) for s, (value, error) in zip(samples, called)]
        scores: list[float] = []
        parts: dict[str, list[float]] = {}
        failed: list[float] = []
        for i, (score, extra, fail) in enumerate(results):
            failed.append(fail)
            scores.append(score)
            for key, v in extra.items():
                parts.setdefault(key, [math.nan] * i).append(v)
            for key in parts:
                if len(parts[key]) < i + 1:
                    parts[key].append(math.nan)  # a part this sample's dict did not have
        if self.errors == "zero":
            parts["errors"] = failed
        return scores, parts

    def _read(self, value: Any) -> tuple[float, dict[str, float]]:
        if isinstance(value, dict):
            if "score" not in value:
                raise RlhpcError(
                    f"the reward {self.spec} returned a dict without 'score' (keys: {', '.join(map(str, value))})",
                    "return {'score': <what to train on>, ...other parts to log}",
                )
            return float(value["score"]), {str(k): float(v) for k, v in value.items() if k != "score"}
        return float(value), {}


ScoreGroups = Callable[[Sequence[Sequence[Sample]]], list[list[float]]]


class GroupScores:
    """A model component's scores of one generation call, group by group (a group: one
    /generate request's samples). ``overlap``: a thread scores each group as soon as ``add`` gets
    it, while generation goes on; every group answered by then goes out in one call of
    ``score_groups`` (one /classify batch per group, spread over the engines); else the groups
    wait for ``scores``, which sends them all at once. A score depends only on its sample, so
    either gives the same scores (the batches are the same groups)."""

    _END = object()

    def __init__(self, score_groups: ScoreGroups, overlap: bool):
        self.score_groups, self.overlap = score_groups, overlap
        self.groups: dict[int, Sequence[Sample]] = {}
        self.scored: dict[int, list[float]] = {}
        self.error: BaseException | None = None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        if overlap:
            self.thread = threading.Thread(target=self._serve, name="score-ahead", daemon=True)
            self.thread.start()

    def add(self, key: int, samples: Sequence[Sample]) -> None:
        self.groups[key] = samples
        if self.overlap:
            self.queue.put(key)

    def _serve(self) -> None:
        ended = False
        while not ended:
            keys = [self.queue.get()]
            while True:  # what else was answered meanwhile goes in the same call
                try:
                    keys.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            ended = self._END in keys
            keys = [k for k in keys if k is not self._END]
            if keys and self.error is None:
                try:
                    self.scored.update(zip(keys, self.score_groups([self.groups[k] for k in keys])))
                except BaseException as e:  # raised in the caller's thread, by ``scores``
                    self.error = e

    def close(self) -> None:
        """No more groups: returns once the thread has scored what it has, so that nothing else
        sends to the reward engines meanwhile (generation was cut short, or is done)."""
        if self.thread is not None:
            self.queue.put(self._END)
            self.thread.join()
            self.thread = None

    def scores(self, keys: Sequence[int]) -> list[float]:
        """Every sample's score, groups in ``keys`` order (all of them added)."""
        self.close()
        if self.error is not None:
            raise self.error
        missing = [k for k in keys if k not in self.scored]
        if missing:
            self.scored.update(zip(missing, self.score_groups([self.groups[k] for k in missing])))
        return [v for k in keys for v in self.scored[k]]


class MixedScorer:
    """``score = rule_weight x rule + sum of weight x component`` (issue 30's reward mixing): the
    rule reward (a ``Scorer``, its dict parts kept) and model components, each ``fn(samples) ->
    one float per sample``. Every component is a part of its own, logged as ``reward/<name>``
    (the rule reward's as ``reward/rule``).

    ``groups``: the components that also score group by group (``score_groups``), so that a
    generation call can score each request's samples as it is answered (``start``) and pass the
    scores in (``ready``); ``overlap``: while generation goes on, else once it is done.
    ``clock``: when the reward model's engines worked (``time/reward_idle``; None: not timed)."""

    def __init__(
        self,
        rule: Scorer,
        rule_weight: float,
        components: dict[str, tuple[float, Callable]],
        groups: dict[str, ScoreGroups] | None = None,
        overlap: bool = True,
        clock: BusyClock | None = None,
    ):
        self.rule, self.rule_weight, self.components = rule, rule_weight, components
        self.groups, self.overlap, self.clock = groups or {}, overlap, clock

    def start(self) -> dict[str, GroupScores]:
        """One generation call's group scorers, one per component that scores groups."""
        return {name: GroupScores(fn, self.overlap) for name, fn in self.groups.items()}

    def __call__(
        self, samples: list[Sample], ready: dict[str, list[float]] | None = None
    ) -> tuple[list[float], dict[str, list[float]]]:
        if not samples:
            return [], {}
        ready = ready or {}
        rule, parts = self.rule(samples)
        scores = [self.rule_weight * r for r in rule]
        parts = {**parts, "rule": rule}
        for name, (weight, fn) in self.components.items():
            values = [float(v) for v in (ready[name] if name in ready else fn(samples))]
            if len(values) != len(samples):
                raise RlhpcError(
                    f"the {name} component scored {len(values)} of {len(samples)} samples", "this is a bug: report it"
                )
            scores = [s + weight * v for s, v in zip(scores, values)]
            parts[name] = values
        return scores, parts
