"""Multi-turn rollouts driven by an environment (``rollout.env: "module:Class"``), token-in/token-out.

The interface (``docs/guides/multi-turn.md``): a class built with no arguments, one per episode, with

- ``reset(row) -> list[dict]``: the first chat messages of the episode. ``row`` is the data row
  as the file has it (``rlhpc.data.rows.Row``: every column, nested as in the file), with
  rlhpc's forms as attributes (``row.messages``, ``row.label``, ``row.prompt_text``) and
  ``row.episode_seed``, an int that is a pure function of (run seed, rollout, sample): seed any
  randomness of the episode from it, and a rerun or a resume replays the episode exactly.
- ``step(assistant_message: str) -> (observation: list[dict], reward: float, done: bool)``: the
  model's reply (the engine's detokenized text) in, the next messages out (usually one
  ``{"role": "user", ...}``), the turn's reward, and whether the episode is over.

Either may be ``async def``. The sample's reward is the sum of the turns' rewards. Either
raising stops the job (``UserCodeError``, naming the method, the row and where it raised).

With tools (``rollout.tools``, ``rlhpc.rollout.tools``) a reply that calls any goes to the tools,
not to ``step``: their answers are the observation, the turn's reward 0, and the episode goes on.
A reply without calls goes to ``step`` as above. Tools without an environment: the episode starts
from the row's prompt (``ChatEnv``), its first reply without calls ends it, and ``data.reward``
scores that reply (``Sample.messages``: the whole conversation).

What rlhpc guarantees: the trained tokens are the engine's tokens, as it produced them. The first
prompt is rendered with the chat template; after that only the observation's tokens are appended
(loss mask 0), computed as the difference between the template rendered with and without the new
messages. A template that breaks this prefix property (one that rewrites earlier turns, such as a
reasoning template that strips earlier thinking) is an error naming the template: rlhpc never
re-tokenizes a turn it trains on.

Those ids are the whole chat's tokenization, but only a tail of it is tokenized each turn: a
tokenizer splits its text at added tokens (ChatML's ``<|im_start|>``, ``<|im_end|>``) before
anything else, so the ids before such a token do not depend on the text after it. Where the new
text is not the old text followed by more, or no such token starts the tail, the whole chat is
tokenized (``Conversation.extend``). The episodes of a rollout take each turn together
(``extend_all``): their chats are rendered in one ``apply_chat_template`` call and their tails
tokenized in one tokenizer call, a text shared by several (the observation's, the generation
prompt's) once; each chat's ids are those it gets alone.

Every rendering goes through ``rlhpc.data.prompts``' one path: each message is marked once, when
it comes (``mark``: the control tokens in its text, a tool answer's ``<|im_end|>`` say, are encoded
as text), and the template's own tokens are the only control tokens an episode is given.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhpc.config import Config, context_len
from rlhpc.data.prompts import (
    MARK_START,
    controls,
    encode_marked,
    mark,
    render_marked,
    require_chat_template,
    with_system,
)
from rlhpc.data.rows import Row, describe
from rlhpc.errors import ConfigError, RlhpcError, UserCodeError, user_code_error
from rlhpc.rollout.journal import ScopeJournal
from rlhpc.rollout.tools import CallSite, Tools, resolve_parser, resolve_tools, warn_special_tags
from rlhpc.rollout.trajectories import Growing
from rlhpc.util.imports import import_function
from rlhpc.wire.tool_calls import markup_text

log = logging.getLogger(__name__)

CHAT_ENV = "rlhpc.rollout.episodes:ChatEnv"  # tools without an environment
ENV_SIGNATURE = "class with reset(row) -> messages and step(assistant_message) -> (messages, reward, done)"


def resolve_env(spec: str, key: str = "rollout.env") -> type:
    """Import ``"module:Class"`` and check it is a class with ``reset`` and ``step``; errors name the key."""
    cls = import_function(key, spec, ENV_SIGNATURE.removeprefix("class "), kind="class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not inspect.isclass(cls) or missing:
        what = "is not a class" if not inspect.isclass(cls) else f"has no {' or '.join(missing)} method"
        raise ConfigError(f"{key} = {spec!r} {what}", f"point it at a {ENV_SIGNATURE}")
    return cls


def check_env(cfg: Config, env: str | None) -> None:
    """A multi-turn run: the environment (None: tools alone) imports and has its methods, the
    tools and their parser import and have schemas, its chat renders, and a whole episode fits
    the context."""
    r = cfg.rollout
    if env is not None:
        key = "rollout.env" if r.env else f"data.task = {cfg.data.task}'s environment"
        resolve_env(env, key)
    else:
        key, env = "rollout.tools", ", ".join(r.tools)
    if r.tools:
        resolve_tools(r.tools)
        resolve_parser(r.tool_parser)
        warn_special_tags(cfg.model.path, "rollout.tools")
    require_chat_template(cfg.data, cfg.model.tiny, f"{key} {env}", "renders its episodes as chat messages")
    context = context_len(cfg)
    prompt = cfg.data.max_prompt_tokens or 1
    if context is not None and prompt + cfg.rollout.max_episode_tokens > context:
        raise ConfigError(
            f"rollout.max_episode_tokens = {cfg.rollout.max_episode_tokens} + a prompt of {prompt} token(s) exceeds "
            f"the model's context length of {context} tokens: the engines would refuse an episode's later turns",
            f"set rollout.max_episode_tokens to at most {context - prompt}, or use a model with a longer context",
        )


class TemplateBreaksPrefix(RlhpcError):
    """The chat template renders earlier turns differently once new messages follow."""


def split_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The added tokens a tokenizer splits its text at wherever they occur: not normalized and
    without ``lstrip`` or ``single_word``, whose match would depend on the text before them."""
    return tuple(
        t.content
        for t in tokenizer.added_tokens_decoder.values()
        if not (t.normalized or t.lstrip or t.single_word) and t.content
    )


def split_before(text: str, end: int, tokens: tuple[str, ...]) -> int:
    """The last offset at most ``end`` where one of ``tokens`` starts and lies whole within
    ``text[:end]`` or starts at ``end``; -1 if none. An occurrence marked as the messages' own text
    (``prompts.mark``) is not one: only the template's tokens split a rendering."""
    best = -1
    for t in tokens:
        at = end if text.startswith(t, end) else text.rfind(t, 0, end)
        while at > 0 and text[at - 1] == MARK_START:
            at = text.rfind(t, 0, at + len(t) - 1)
        best = max(best, at)
    return best


class Conversation:
    """One episode's chat, rendered incrementally: ``prompt_ids`` first, then for each assistant
    turn the tokens to append after the engine's own (``extend``; ``extend_all`` for many chats
    at once)."""

    def __init__(
        self, tokenizer: Any, template: str, template_name: str, messages: list[dict], tools: list[dict] | None = None
    ):
        c = controls(tokenizer, template)
        marked, marked_tools = mark(list(messages), c), mark(tools, c)
        (text,) = render_marked(tokenizer, template, [marked], True, marked_tools)
        ids = encode_marked(tokenizer, template, [text])[text]
        self._start(tokenizer, template, template_name, messages, tools, text, ids, split_tokens(tokenizer))
        self._marked, self._marked_tools = marked, marked_tools

    def _start(
        self, tokenizer: Any, template: str, template_name: str, messages: list[dict], tools: list[dict] | None,
        text: str, ids: list[int], split: tuple[str, ...],
    ) -> None:  # fmt: skip
        self.tokenizer, self.template, self.template_name = tokenizer, template, template_name
        self.tools = tools  # OpenAI tool schemas, rendered by the template every time (it lists them first)
        self.messages = list(messages)
        # the messages and tools as the template is given them (prompts.mark: their control tokens
        # marked as text), each marked once; the text as rendered from them
        self._marked: list[dict] = []
        self._marked_tools: list[dict] | None = None
        self._text, self.prompt_ids = text, ids
        self._rendered = self.prompt_ids  # the template's ids of the chat so far, generation prompt included
        self._split = split
        self.whole_tokenized = 0  # turns whose chat was tokenized whole (the fallback)

    @classmethod
    def start_all(
        cls, tokenizer: Any, template: str, template_name: str, chats: list[list[dict]], tools: list[dict] | None = None
    ) -> list[Conversation]:
        """``Conversation(tokenizer, template, template_name, chat, tools)`` of each of ``chats``:
        the same ids, the chats rendered in one call and each distinct text tokenized once."""
        chats = [list(chat) for chat in chats]
        marks = controls(tokenizer, template)
        marked, marked_tools = [mark(chat, marks) for chat in chats], mark(tools, marks)
        texts = render_marked(tokenizer, template, marked, True, marked_tools)
        ids, split, out = encode_marked(tokenizer, template, texts), split_tokens(tokenizer), []
        for chat, m, text in zip(chats, marked, texts):
            c = cls.__new__(cls)
            c._start(tokenizer, template, template_name, chat, tools, text, list(ids[text]), split)
            c._marked, c._marked_tools = m, marked_tools
            out.append(c)
        return out

    def _tail_texts(self, reply: str, closed: str, after: str) -> list[str] | None:
        """The texts whose ids give the turn's (``_from_tails``): the reply, and tails that start
        at a split token; None where the texts do not grow by appending or no split token starts
        a tail."""
        before = self._text
        if not (closed.startswith(before) and after.startswith(closed)):
            return None  # the whole chat's ids decide whether the template breaks the prefix property
        p0, p1 = split_before(closed, len(before), self._split), split_before(after, len(closed), self._split)
        if p0 < 0 or p1 < 0:
            return None
        return [reply, before[p0:], closed[p0:], closed[p1:], after[p1:]]

    def _from_tails(
        self, content: list[int], old0: list[int], new0: list[int], old1: list[int], new1: list[int]
    ) -> tuple[list[int], list[int], list[int]] | None:
        """(reply's ids, closed's ids, after's ids) from the previous turn's ids and the ids of
        ``_tail_texts``; None where the previous ids do not end with their tail's."""
        # the previous ids end with their tail's: the split token at p0 is where they split
        if self._rendered[len(self._rendered) - len(old0) :] != old0:
            return None
        closed_ids = self._rendered[: len(self._rendered) - len(old0)] + new0
        if closed_ids[len(closed_ids) - len(old1) :] != old1:
            return None
        return content, closed_ids, closed_ids[: len(closed_ids) - len(old1)] + new1

    def _require(self, ok: bool, what: str) -> None:
        if not ok:
            raise TemplateBreaksPrefix(
                f"the chat template {self.template_name} {what}, so the tokens trained on would not be the "
                "tokens generated (rlhpc appends only the new messages' tokens, it never re-tokenizes a turn)",
                "use a template that renders earlier turns unchanged as the chat grows (data.chat_template: a "
                "Jinja file), e.g. one that keeps the assistant's reasoning instead of stripping it",
            )

    def _grow(
        self, generated: Sequence[int], messages: list[dict], marked: list[dict], after_text: str,
        content: list[int], closed: list[int], after: list[int],
    ) -> list[int]:  # fmt: skip
        before = self._rendered
        self._require(closed[: len(before)] == before, "renders the chat before the assistant's turn differently")
        self._require(after[: len(closed)] == closed, "renders earlier turns differently once new messages follow")
        turn = closed[len(before) :]
        self._require(turn[: len(content)] == content, "does not render the assistant's reply as it was generated")
        closing = turn[len(content) :]
        # the engine's stop token (<|im_end|>) is the closing's first token: not appended twice
        done = max(
            k
            for k in range(len(closing) + 1)
            if k <= len(generated) and list(generated[len(generated) - k :]) == closing[:k]
        )
        self.messages, self._marked, self._text, self._rendered = messages, marked, after_text, after
        return closing[done:] + after[len(closed) :]

    def extend(self, generated: Sequence[int], reply: str, observation: list[dict]) -> list[int]:
        """The tokens that follow the engine's ``generated`` ids (its text: ``reply``) when
        ``observation`` is the next message(s): what the template closes the assistant's turn
        with, less what the engine already produced (its stop token), then the observation and
        the next generation prompt."""
        return extend_all([self], [generated], [reply], [observation])[0]


def extend_all(
    chats: Sequence[Conversation],
    generated: Sequence[Sequence[int]],
    replies: Sequence[str],
    observations: Sequence[list[dict]],
) -> list[list[int]]:
    """``chat.extend(generated, reply, observation)`` of each chat, the same tokens, for one turn
    of many episodes: the chats rendered in one call with the reply and one with the observation
    too, their tails tokenized in one call, each distinct text once (tails such as the
    observation's and the generation prompt's recur across episodes)."""
    if not chats:
        return []
    first = chats[0]
    if any(
        c.tokenizer is not first.tokenizer or c.template != first.template or c.tools is not first.tools for c in chats
    ):
        return [extend_all([c], [g], [r], [o])[0] for c, g, r, o in zip(chats, generated, replies, observations)]
    tok, template, tools = first.tokenizer, first.template, first._marked_tools
    marks = controls(tok, template)
    # only the new messages are marked (prompts.mark): the earlier ones were when they came
    marked = [mark(r, marks) for r in replies]
    closed_chats = [[*c._marked, {"role": "assistant", "content": r}] for c, r in zip(chats, marked)]
    after_chats = [chat + mark(list(observation), marks) for chat, observation in zip(closed_chats, observations)]
    closed_texts = render_marked(tok, template, closed_chats, False, tools)
    after_texts = render_marked(tok, template, after_chats, True, tools)
    tails = [c._tail_texts(r, x, y) for c, r, x, y in zip(chats, marked, closed_texts, after_texts)]
    ids = encode_marked(tok, template, [t for texts in tails if texts is not None for t in texts])
    found = [c._from_tails(*(ids[t] for t in texts)) if texts is not None else None for c, texts in zip(chats, tails)]
    whole = [k for k, f in enumerate(found) if f is None]  # the fallback: the whole chats tokenized
    ids.update(encode_marked(tok, template, [t for k in whole for t in (marked[k], closed_texts[k], after_texts[k])]))
    out = []
    for k, c in enumerate(chats):
        if found[k] is None:
            c.whole_tokenized += 1
            found[k] = (ids[marked[k]], ids[closed_texts[k]], ids[after_texts[k]])
        content, closed, after = found[k]
        messages = [*c.messages, {"role": "assistant", "content": replies[k]}, *observations[k]]
        out.append(c._grow(generated[k], messages, after_chats[k], after_texts[k], content, closed, after))
    return out


@dataclass
class Episode(Growing):
    """One sample's episode as it runs: the response grows by generated and observation tokens."""

    env: Any
    conversation: Conversation
    row: Row | None = None  # what it was reset with (for errors)
    index: int = 0  # its place among the generation's episodes (the tool journal's key)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    turn: int = 0
    done: bool = False
    truncated: bool = False
    texts: list[str] = field(default_factory=list)  # the assistant's replies
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    infra_failed: bool = False  # a tool could not run (InfrastructureFailure): ended, unscored

    @property
    def input_ids(self) -> list[int]:
        return self.conversation.prompt_ids + self.response_ids

    def reply_ids(self) -> list[int]:
        """The engine's tokens of the current turn's reply."""
        return [t for t, m, u in zip(self.response_ids, self.loss_mask, self.turns) if m and u == self.turn]


Failed = Callable[[int, Exception], UserCodeError]  # (index of the call, what it raised) -> the error


def _call(loop: asyncio.AbstractEventLoop, fns: list[Callable[[], Any]], failed: Failed) -> list[Any]:
    """Call each of ``fns`` (the user's code); those that return awaitables run concurrently on
    ``loop``. One that raises is ``failed(i, error)``, raised."""

    def guarded(i: int, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except RlhpcError:
            raise
        except Exception as e:
            raise failed(i, e) from e

    async def awaited(i: int, result: Any) -> Any:
        try:
            return await result
        except RlhpcError:
            raise
        except Exception as e:
            raise failed(i, e) from e

    results = [guarded(i, fn) for i, fn in enumerate(fns)]
    waiting = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
    if waiting:

        async def gather() -> list[Any]:
            return await asyncio.gather(*(awaited(i, results[i]) for i in waiting))

        for i, r in zip(waiting, loop.run_until_complete(gather())):
            results[i] = r
    return results


def _observation(spec: str, result: Any) -> tuple[list[dict], float, bool]:
    try:
        messages, reward, done = result
        messages = [messages] if isinstance(messages, dict) else list(messages)
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise TypeError(f"observation {messages!r} is not a list of chat messages")
        return messages, float(reward), bool(done)
    except (TypeError, ValueError) as e:
        raise RlhpcError(
            f"the environment {spec}'s step returned {str(result)[:200]}: {e}",
            "return (observation messages, reward, done), e.g. ([{'role': 'user', 'content': 'higher'}], 0.0, False)",
        ) from e


class ChatEnv:
    """The environment of tools without one: the row's prompt (its chat messages, or its text as
    a user message) opens the episode, and the first reply without tool calls ends it, scored
    afterwards by ``data.reward`` (``EpisodeConfig.score_replies``)."""

    def reset(self, row: Row) -> list[dict]:
        return list(row.messages)

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        return [], 0.0, True


@dataclass(frozen=True)
class EpisodeConfig:
    """What ``Generation`` needs to run episodes (``make_episodes``)."""

    spec: str  # the environment's "module:Class"
    env_cls: type
    template: str
    template_name: str
    system_prompt: str | None
    max_turns: int
    max_episode_tokens: int
    tools: Tools | None = None
    score_replies: bool = False  # ChatEnv: data.reward scores each episode's last reply

    def start(self, tokenizer: Any, row: Row, episode_seed: int, loop: asyncio.AbstractEventLoop) -> Episode:
        return self.start_all(tokenizer, [(row, episode_seed)], loop)[0]

    def _failed(self, method: str, rows: Sequence[Row | None]) -> Failed:
        return lambda i, e: user_code_error(f"the environment {self.spec}'s {method}", e, _episode_of(rows[i]))

    def start_all(self, tokenizer: Any, rows: list[tuple[Row, int]], loop: asyncio.AbstractEventLoop) -> list[Episode]:
        """An episode of each (row, episode seed) of ``rows``, its environment reset, their first
        prompts rendered together (``Conversation.start_all``)."""
        envs, chats, seeded = [], [], []
        for row, episode_seed in rows:
            row = row.with_seed(episode_seed)
            seeded.append(row)
            try:
                env = self.env_cls()
            except Exception as e:
                raise user_code_error(
                    f"the environment {self.spec} (built with no arguments)", e, _episode_of(row)
                ) from e
            (messages,) = _call(loop, [lambda e=env, r=row: e.reset(r)], self._failed("reset", [row]))
            if not isinstance(messages, list) or not messages:
                raise RlhpcError(
                    f"the environment {self.spec}'s reset returned {str(messages)[:200]}, not a list of chat messages",
                    "return the episode's first messages, e.g. [{'role': 'user', 'content': 'guess a number'}]",
                )
            envs.append(env)
            chats.append(with_system(messages, self.system_prompt))
        schemas = self.tools.schemas if self.tools is not None else None
        conversations = Conversation.start_all(tokenizer, self.template, self.template_name, chats, schemas)
        return [Episode(env, c, row, k) for k, (env, c, row) in enumerate(zip(envs, conversations, seeded))]

    def step(
        self,
        episodes: list[Episode],
        replies: list[str],
        loop: asyncio.AbstractEventLoop,
        journal: ScopeJournal | None = None,
    ) -> list[tuple]:
        """Each episode's (observation, reward, done) after its reply: the tools' answers where the
        reply calls tools (every episode's calls run at once; ``journal``: recorded there, and
        answered from it where it holds them), ``env.step``'s elsewhere."""
        for e, r in zip(episodes, replies):
            e.texts.append(r)
        # the calls read from the reply's tokens with special tokens kept (markup_text): where
        # <tool_call> is a special token, the engine's text (what step gets) has no markup left
        calls = [self._calls(e, markup_text(e.conversation.tokenizer, e.reply_ids())) for e in episodes]
        to_env = [i for i, c in enumerate(calls) if not c]
        results: list[tuple] = [()] * len(episodes)
        stepped = _call(
            loop,
            [lambda e=episodes[i], r=replies[i]: e.env.step(r) for i in to_env],
            self._failed("step", [episodes[i].row for i in to_env]),
        )
        for i, result in zip(to_env, stepped):
            results[i] = _observation(self.spec, result)
        to_tools = [i for i, c in enumerate(calls) if c]
        if to_tools:
            assert self.tools is not None
            sites = [CallSite(episodes[i].index, episodes[i].turn, _seed_of(episodes[i].row)) for i in to_tools]
            answers, counts = self.tools.run([calls[i] for i in to_tools], sites, journal)
            for i, messages, n in zip(to_tools, answers, counts):
                e = episodes[i]
                e.tool_calls, e.tool_errors, e.tool_timeouts = (
                    e.tool_calls + n.calls, e.tool_errors + n.errors, e.tool_timeouts + n.timeouts,
                )  # fmt: skip
                e.infra_failed = e.infra_failed or n.infra > 0
                results[i] = (messages, 0.0, e.infra_failed)  # a tool that could not run ends the episode
        return results

    def _calls(self, episode: Episode, reply: str) -> list:
        """The tool calls in ``reply`` (none without tools); the parser raising is its error."""
        if self.tools is None:
            return []
        try:
            return self.tools.calls(reply)
        except RlhpcError:
            raise
        except Exception as e:
            on = f"the reply {reply[:80]!r} in {_episode_of(episode.row)}"
            raise user_code_error(f"the tool parser {getattr(self.tools.parser, '__qualname__', '')}", e, on) from e


def _seed_of(row: Row | None) -> int | None:
    return row.episode_seed if row is not None else None


def _episode_of(row: Row | None) -> str:
    return f"the episode of {describe(row)}" if row is not None else "an episode"


def make_episodes(cfg: Any, tokenizer: Any) -> EpisodeConfig | None:
    """The run's episode settings from its ``Config``; None without an environment (single-turn)."""
    from rlhpc.data.prompts import conversation_template
    from rlhpc.data.tasks import TASKS

    r = cfg.rollout
    spec = r.env or TASKS[cfg.data.task].env or (CHAT_ENV if r.tools else None)
    if spec is None:
        return None
    template, name = conversation_template(cfg.data, tokenizer, f"rollout.env = {spec}")
    tools = Tools(resolve_tools(r.tools), resolve_parser(r.tool_parser), r.tool_timeout_s) if r.tools else None
    return EpisodeConfig(
        spec, resolve_env(spec), template, name, cfg.data.system_prompt, r.max_turns, r.max_episode_tokens,
        tools, spec == CHAT_ENV,
    )  # fmt: skip
