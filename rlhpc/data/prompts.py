"""How a data row becomes the token ids the engines are sent, on the driver, once at load.

- A text prompt is encoded with the special tokens the tokenizer itself adds (Llama's BOS, none
  for Qwen's): a BOS is never assumed.
- A prompt that is a list of chat messages is rendered with a chat template (``data.chat_template``:
  ``auto``, the tokenizer's own; or a Jinja file), ``data.system_prompt`` first where it has no
  system message, and the generation prompt after; its ids are what ``transformers``'
  ``apply_chat_template`` gives, and they travel with the row (``prompt_ids``), so what is trained
  is what was generated. The rendered text is the row's ``prompt_text`` (what a reward reads);
  the row's own columns stay as the file has them (``rlhpc.data.rows``).
- A prompt longer than its split's limit is dropped, and counted in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhpc.data.rows import Row, as_rows
from rlhpc.errors import ConfigError, RlhpcError

if TYPE_CHECKING:
    from rlhpc.config import DataConfig, TinyModelConfig

log = logging.getLogger(__name__)

PromptPrep = Callable[[str, list[Row]], list[Row]]  # (split name, rows) -> the rows to use


def encode_prompts(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """Token ids of each text prompt with the special tokens the tokenizer itself adds. An empty
    encoding is an error naming the prompt."""
    encoded = tokenizer(prompts, add_special_tokens=True).input_ids
    for text, ids in zip(prompts, encoded):
        if not ids:
            raise RlhpcError(
                f"the prompt {text[:80]!r} encodes to no tokens with this tokenizer (and it adds no BOS)",
                "drop empty prompts from the data, or give each one some text",
            )
    return encoded


def encode_rows(tokenizer: Any, rows: list[Row]) -> list[list[int]]:
    """The ids to send for each row: a rendered chat prompt's own, a text prompt's encoding."""
    texts = [i for i, row in enumerate(rows) if row.prompt_ids is None]
    encoded = dict(zip(texts, encode_prompts(tokenizer, [rows[i].prompt_text for i in texts]))) if texts else {}
    return [encoded[i] if i in encoded else rows[i].prompt_ids for i in range(len(rows))]


def chat_template(data: DataConfig, tokenizer: Any) -> str | None:
    """The Jinja template message lists are rendered with (None: ``data.chat_template = none``)."""
    if data.chat_template == "none":
        return None
    if data.chat_template == "auto":
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "the prompts are chat messages but the model's tokenizer ships no chat template",
                "set data.chat_template to a Jinja file, or give the prompts as text",
            )
        return tokenizer.chat_template
    return Path(data.chat_template).read_text()


def conversation_template(data: DataConfig, tokenizer: Any, user: str) -> tuple[str, str]:
    """(template, its name for errors) for a multi-turn ``user`` (e.g. ``rollout.env = X``), which
    cannot run with ``data.chat_template: none``."""
    template = chat_template(data, tokenizer)
    if template is None:
        raise ConfigError(
            f"{user} talks in chat messages, but data.chat_template is none",
            "set data.chat_template: auto (the tokenizer's template) or a Jinja file",
        )
    return template, "of the tokenizer" if data.chat_template == "auto" else data.chat_template


def require_chat_template(data: DataConfig, tiny: TinyModelConfig | None, user: str, uses: str) -> None:
    """Before submission: a multi-turn ``user`` (e.g. ``rollout.env = X``), which ``uses`` chat
    messages, has a chat template to render them with."""
    if data.chat_template == "none":
        raise ConfigError(
            f"{user} {uses} but data.chat_template is none",
            "set data.chat_template: auto (the tokenizer's template) or a Jinja file",
        )
    if tiny is not None and tiny.tokenizer == "char" and data.chat_template == "auto":
        raise ConfigError(
            f"{user} needs a chat template, and the tiny model's char tokenizer has none",
            "set model.tiny.tokenizer: bpe (a ChatML template, as Qwen's), or data.chat_template: a Jinja file",
        )


def render(tokenizer: Any, template: str, messages: list[dict], system_prompt: str | None) -> tuple[str, list[int]]:
    """(text, ids) of ``messages`` with the generation prompt, by ``apply_chat_template``."""
    return render_messages(tokenizer, template, with_system(messages, system_prompt), add_generation_prompt=True)


def with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """``messages`` with ``data.system_prompt`` first where they have no system message."""
    if system_prompt is not None and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def render_messages(
    tokenizer: Any, template: str, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
) -> tuple[str, list[int]]:
    """(text, ids) of ``messages`` as ``apply_chat_template`` renders them (``tools``: OpenAI
    tool schemas, for templates that list them)."""
    text = render_text(tokenizer, template, messages, add_generation_prompt, tools)
    return text, encode_text(tokenizer, text)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """A rendered chat's ids as ``apply_chat_template(tokenize=True)`` gives them, without
    rendering it again: the template writes its own special tokens, none is added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_texts(
    tokenizer: Any, template: str, chats: list[list[dict]], add_generation_prompt: bool, tools: list[dict] | None = None
) -> list[str]:
    """``render_text`` of each of ``chats``, in one ``apply_chat_template`` call: it renders them
    one by one, each to the text it renders alone, and pays its per-call work once."""
    if not chats:
        return []
    extra = {"tools": tools} if tools else {}
    try:
        texts = tokenizer.apply_chat_template(
            chats, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception:
        for messages in chats:  # the error names the first chat that does not render
            render_text(tokenizer, template, messages, add_generation_prompt, tools)
        raise
    return list(texts)


def render_text(
    tokenizer: Any, template: str, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
) -> str:
    """The text ``apply_chat_template`` renders ``messages`` to, not tokenized (``transformers``
    caches the compiled template, so this is the Jinja rendering alone)."""
    extra = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception as e:  # jinja2's errors: a template that does not render these messages
        raise ConfigError(
            f"the chat template does not render the messages {str(messages)[:120]} ({type(e).__name__}: {e})",
            "fix data.chat_template (a Jinja file), or use the tokenizer's own (auto)",
        ) from e
    return text


def prepare_prompts(tokenizer: Any, data: DataConfig, limits: dict[str, int] | None) -> PromptPrep:
    """A ``PromptPrep``: chat rows rendered (``render``), then the rows whose prompt is longer
    than ``limits[split]`` tokens dropped (one too long for the context would fail a whole
    rollout; dropping every row is an error naming the limit and the fix)."""

    def prepare(split: str, rows: list[Row]) -> list[Row]:
        rows = as_rows(rows)
        template = chat_template(data, tokenizer) if any(r.is_chat for r in rows) else None
        ready = []
        for row in rows:
            if row.is_chat:
                text, ids = render(tokenizer, template, row.messages, data.system_prompt)
                row = row.derive(prompt_text=text, prompt_ids=ids)
            ready.append(row)
        if limits is None:
            return ready
        limit = limits[split]
        lengths = [len(ids) for ids in encode_rows(tokenizer, ready)]
        kept = [r for r, n in zip(ready, lengths) if n <= limit]
        if not kept:
            raise ConfigError(
                f"every {split} prompt is longer than {limit} tokens (the shortest has {min(lengths)})",
                "raise data.max_prompt_tokens, lower max_new_tokens, or use a model with a longer context",
            )
        if len(kept) < len(ready):
            log.warning(
                "%s data: %d of %d prompts are longer than %d tokens and were dropped (data.max_prompt_tokens)",
                split, len(ready) - len(kept), len(ready), limit,
            )  # fmt: skip
        return kept

    return prepare
