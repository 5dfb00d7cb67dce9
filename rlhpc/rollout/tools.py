"""Tools in episodes (``rollout.tools: ["module:fn", ...]``, ``docs/guides/multi-turn.md``).

A tool is a plain typed Python function, ``def calculator(expression: str) -> str``. Its OpenAI
tool schema comes from its signature (``tool_schema``) and goes to the chat template's ``tools``;
the model's replies are read for calls by ``rollout.tool_parser`` (by default the Hermes/Qwen
``<tool_call>`` parser of ``rlhpc.wire.tool_calls``); ``Tools.run`` runs one turn's calls,
all of them at once, each cut at ``rollout.tool_timeout_s``, and answers each with a
``{"role": "tool", "name": ..., "content": ...}`` message. A tool that raises, times out, or does
not exist answers ``"error: ..."``: the episode goes on, and the error is counted. A tool that
raises ``rlhpc.errors.InfrastructureFailure`` (its sandbox could not run) ends its episode
unscored instead: the episode is masked out of training, as a reward's infrastructure failure is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import json
import logging
import threading
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlhpc.errors import ConfigError, InfrastructureFailure, RlhpcError
from rlhpc.rollout.journal import Recorded, ScopeJournal, arguments_key
from rlhpc.wire.tool_calls import ParsedCall, ParsedOutput, special_tags

log = logging.getLogger(__name__)

DEFAULT_PARSER = "rlhpc.wire.tool_calls:parse_hermes"
TOOL_SIGNATURE = "a function whose parameters are annotated with str, int, float, bool, list, dict, Optional or Literal"
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _import(spec: str, key: str, what: str) -> Any:
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"{key} = {spec!r} is not 'module:function'", f"write {key}: my_module:my_fn, {what}")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"{key} = {spec!r} cannot be imported: {e}",
            "make the module importable from the job (PYTHONPATH) and check the function's name",
        ) from e


def json_schema(tp: Any, where: str) -> dict:
    """The JSON schema of the annotation ``tp``; ``where`` names it in the error for a type JSON cannot carry."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if tp is type(None):
        return {"type": "null"}
    if tp is list or origin is list:
        return {"type": "array", **({"items": json_schema(args[0], where)} if args else {})}
    if tp is dict or origin is dict:
        if args and args[0] is not str:
            raise ConfigError(f"{where} is {tp}: JSON objects have string keys", "annotate it dict[str, ...] or dict")
        return {"type": "object", **({"additionalProperties": json_schema(args[1], where)} if args else {})}
    if origin is Literal:
        kinds = {_SCALARS.get(type(a)) for a in args}
        if None in kinds:
            raise ConfigError(f"{where} is {tp}: only str, int, float and bool literals", "use such values")
        return {"type": kinds.pop(), "enum": list(args)} if len(kinds) == 1 else {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):  # Optional[X] is Union[X, None]
        return {"anyOf": [json_schema(a, where) for a in args]}
    raise ConfigError(f"{where} is annotated {tp!r}, which JSON cannot carry", f"annotate it as {TOOL_SIGNATURE}")


def tool_schema(fn: Callable, key: str = "rollout.tools") -> dict:
    """The OpenAI tool schema of ``fn``: its name, its docstring, and its parameters (those with
    no default are required)."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        hints = typing.get_type_hints(fn)
        params = inspect.signature(fn).parameters.values()
    except (NameError, TypeError, ValueError) as e:
        raise ConfigError(f"{key}: the tool {name}'s signature cannot be read: {e}", f"make it {TOOL_SIGNATURE}") from e
    properties, required = {}, []
    for p in params:
        where = f"{key}: the tool {name}'s parameter {p.name}"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ConfigError(f"{where} is not a named parameter", "the model passes arguments by name: name each")
        if p.name not in hints:
            raise ConfigError(f"{where} has no type annotation", f"annotate it, e.g. {p.name}: str")
        properties[p.name] = json_schema(hints[p.name], where)
        if p.default is p.empty:
            required.append(p.name)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": inspect.getdoc(fn) or "",
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def resolve_tools(specs: Sequence[str], key: str = "rollout.tools") -> list[Callable]:
    """Import each ``"module:fn"``, check it is callable with a schema, and that no two share a name."""
    fns = []
    for i, spec in enumerate(specs):
        fn = _import(spec, f"{key}[{i}]", TOOL_SIGNATURE)
        if not callable(fn) or inspect.isclass(fn):
            raise ConfigError(f"{key}[{i}] = {spec!r} is not a function", f"point it at {TOOL_SIGNATURE}")
        tool_schema(fn, f"{key}[{i}]")
        fns.append(fn)
    names = [fn.__name__ for fn in fns]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(
            f"{key} has two tools named {', '.join(twice)}: the model calls tools by name",
            "give each tool function its own name",
        )
    return fns


def resolve_parser(spec: str, key: str = "rollout.tool_parser") -> Callable[[str], Any]:
    fn = _import(spec, key, "a function (reply text) -> ParsedOutput or a list of ParsedCall")
    if not callable(fn):
        raise ConfigError(f"{key} = {spec!r} is not callable", "point it at a function of the reply's text")
    return fn


def warn_special_tags(model_path: str | None, user: str) -> list[str]:
    """At submit, for a run whose model calls tools (``user``: the key that makes it so): where the
    model's tokenizer makes the ``<tool_call>`` tags special tokens, a warning that text decoded
    without special tokens loses them. rlhpc reads calls with them kept (``tool_calls.markup_text``);
    what an environment's ``step``, a reward, or an agent reading calls out of a reply's content
    get is the engine's text, which holds none. The tags found (none: no warning)."""
    tags = special_tags(_added_tokens(Path(model_path))) if model_path and Path(model_path).is_dir() else []
    if tags:
        log.warning(
            "%s: %s %s special tokens of the model's tokenizer (%s). rlhpc reads tool calls with special tokens "
            "kept, but text decoded without them has no %s: an environment's step and a reward get such text, and "
            "so does an agent that reads calls out of a reply's content: offer the tools in its requests (tools=...) "
            "and read message.tool_calls instead",
            user, " and ".join(tags), "is" if len(tags) == 1 else "are", model_path, tags[0],
        )  # fmt: skip
    return tags


def _added_tokens(model_dir: Path) -> dict[str, bool]:
    """A saved tokenizer's added tokens (content -> special), from its files (no tokenizer loaded)."""
    added: dict[str, bool] = {}
    try:
        fast = json.loads((model_dir / "tokenizer.json").read_text())
        added.update({t["content"]: bool(t.get("special")) for t in fast.get("added_tokens", [])})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        for t in (config.get("added_tokens_decoder") or {}).values():
            added[t["content"]] = added.get(t["content"], False) or bool(t.get("special"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return added


@dataclass
class ToolCounts:
    """One turn's tally, per episode."""

    calls: int = 0
    errors: int = 0  # raised, or no such tool
    timeouts: int = 0
    infra: int = 0  # raised InfrastructureFailure (a sandbox that could not run): the episode is masked


@dataclass(frozen=True)
class CallSite:
    """Where a call was made: its episode's place among the generation's episodes, the turn of
    the reply that made it, and the episode's ``episode_seed`` (a pure function of run seed,
    rollout and sample: the episode's identity across runs). ``current_call()`` in a tool."""

    episode: int
    turn: int
    episode_seed: int | None = None
    index: int = 0  # the call's place among its reply's calls


_calling = threading.local()


def current_call() -> CallSite | None:
    """In a tool, the call it is answering (``CallSite``): to keep state per episode, or to log;
    None outside a tool call of an episode. (A resumed episode answers recorded calls from the
    tool journal without running the tool, so state a tool keeps is not rebuilt for them.)"""
    return getattr(_calling, "site", None)


class _Run:
    """One call, run on a thread of its own; ``content`` is set when it returns or raises."""

    def __init__(self, fn: Callable, call: ParsedCall, site: CallSite | None = None):
        self.fn, self.call, self.site = fn, call, site
        self.content: str | None = None
        self.error = False
        self.infra = False
        self.thread = threading.Thread(target=self._run, name=f"tool-{call.name}", daemon=True)

    def _run(self) -> None:
        _calling.site = self.site
        try:
            args = self.call.arguments
            args = json.loads(args) if isinstance(args, str) else args
            if not isinstance(args, dict):
                raise TypeError(f"arguments {self.call.arguments!r} are not a JSON object")
            result = self.fn(**args)
            if inspect.isawaitable(result):  # an async def tool: its own loop, on this thread
                result = asyncio.run(result)
            self.error, self.content = (
                False,
                result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str),
            )
        except InfrastructureFailure as e:  # not the model's doing: its episode ends unscored
            log.warning("tool %s failed for infrastructure: %s", self.call.name, e)
            self.infra, self.content = True, f"error: the tool could not run: {e}"
        except Exception as e:  # the model's arguments or the tool's own failure: the model reads it
            log.debug("tool %s raised %s: %s", self.call.name, type(e).__name__, e)
            self.error, self.content = True, f"error: {type(e).__name__}: {e}"


class Tools:
    """The run's tools: their schemas for the chat template, and ``run`` for a turn's calls."""

    def __init__(self, fns: Sequence[Callable], parser: Callable[[str], Any], timeout_s: float):
        self.fns = {fn.__name__: fn for fn in fns}
        self.schemas = [tool_schema(fn) for fn in fns]
        self.parser, self.timeout_s = parser, timeout_s

    def calls(self, reply: str) -> list[ParsedCall]:
        """The calls in ``reply``, as the parser reads them (unknown names kept: ``run`` answers them)."""
        out = self.parser(reply)
        calls = out.calls if isinstance(out, ParsedOutput) else out
        try:
            return [c if isinstance(c, ParsedCall) else ParsedCall(c.name, c.arguments) for c in calls]
        except (AttributeError, TypeError) as e:
            raise RlhpcError(
                f"the tool parser returned {str(out)[:200]}, not calls: {e}",
                "return a ParsedOutput or a list of ParsedCall(name, arguments) (rlhpc.wire.tool_calls)",
            ) from e

    def run(
        self,
        calls: Sequence[Sequence[ParsedCall]],
        sites: Sequence[CallSite] | None = None,
        journal: ScopeJournal | None = None,
    ) -> tuple[list[list[dict]], list[ToolCounts]]:
        """Run every episode's calls (``calls[i]``: episode i's, in its reply's order) at once; the
        tool messages answering them, in the same order, and each episode's counts. ``sites[i]``:
        where episode i's calls were made (``current_call`` in the tool). With a ``journal``
        (``rlhpc.rollout.journal``) a call it recorded is answered from it, not run, and every
        answer of a call run is recorded."""
        # Threads, not processes: tools are mostly I/O (a request, a subprocess) and need not be
        # picklable or importable in a fresh process. Daemon threads, not a pool: a call cut at the
        # timeout cannot be killed, and a pool's workers are joined when the interpreter exits,
        # so one hung tool would hang the job's end; a daemon thread is left behind instead.
        runs: list[list[_Run | ParsedCall | Recorded]] = []
        for i, cs in enumerate(calls):
            row: list[_Run | ParsedCall | Recorded] = []
            for j, c in enumerate(cs):
                site = dataclasses.replace(sites[i], index=j) if sites is not None else None
                found = journal.lookup(site.episode, site.turn, j, c) if journal is not None and site else None
                row.append(found if found is not None else _Run(self.fns[c.name], c, site) if c.name in self.fns else c)
            runs.append(row)
        started = [r for rs in runs for r in rs if isinstance(r, _Run)]
        for r in started:
            r.thread.start()
        deadline = time.monotonic() + self.timeout_s
        for r in started:
            r.thread.join(max(0.0, deadline - time.monotonic()))
        messages, counts, answered = [], [], []
        for i, rs in enumerate(runs):
            out, n = [], ToolCounts(calls=len(rs))
            for j, r in enumerate(rs):
                if isinstance(r, ParsedCall):
                    n.errors += 1
                    name, content = r.name, f"error: no tool named {r.name!r}; the tools are {', '.join(self.fns)}"
                    out.append({"role": "tool", "name": name, "content": content})
                    continue
                if isinstance(r, Recorded):  # answered as the journal recorded it
                    answer = r
                elif r.content is None:  # still running: abandoned, its result never read
                    log.warning("tool %s still running after %s s; answered as timed out", r.call.name, self.timeout_s)
                    answer = Recorded(
                        r.call.name, arguments_key(r.call.arguments), f"error: timed out after {self.timeout_s:g} s",
                        timeout=True,
                    )  # fmt: skip
                else:
                    answer = Recorded(r.call.name, arguments_key(r.call.arguments), r.content, r.error, infra=r.infra)
                if isinstance(r, _Run) and sites is not None:
                    answered.append((sites[i].episode, sites[i].turn, j, answer))
                n.errors, n.timeouts, n.infra = (
                    n.errors + answer.error,
                    n.timeouts + answer.timeout,
                    n.infra + answer.infra,
                )
                out.append({"role": "tool", "name": answer.name, "content": answer.content})
            messages.append(out)
            counts.append(n)
        if journal is not None:
            journal.record(answered)  # before the episodes go on: a kill from here on replays them
        return messages, counts
