"""How a data row becomes the token ids the engines are sent, on the driver, once at load.

- A text prompt is encoded with the special tokens the tokenizer itself adds (Llama's BOS, none
  for Qwen's): a BOS is never assumed.
- A prompt that is a list of chat messages is rendered with a chat template (``data.chat_template``:
  ``auto``, the tokenizer's own; or a Jinja file), ``data.system_prompt`` first where it has no
  system message, and the generation prompt after; its ids are what ``transformers``'
  ``apply_chat_template`` gives, and they travel with the row (``prompt_ids``), so what is trained
  is what was generated. The rendered text is the row's ``prompt_text`` (what a reward reads);
  the row's own columns stay as the file has them (``rlhpc.data.rows``). Control tokens in the
  messages' own text stay text (``render_chats``, below: the one rendering path of every chat
  rlhpc tokenizes).
- A prompt longer than its split's limit is dropped, and counted in the log.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhpc.data.images import expand_pads, with_image_parts
from rlhpc.data.rows import Row, as_rows
from rlhpc.errors import ConfigError, RlhpcError

if TYPE_CHECKING:
    from rlhpc.config import DataConfig, TinyModelConfig
    from rlhpc.data.images import ImageRef, Vision

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
    """(text, ids) of ``messages`` with the generation prompt (``render_chat``)."""
    return render_chat(tokenizer, template, with_system(messages, system_prompt), add_generation_prompt=True)


def with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """``messages`` with ``data.system_prompt`` first where they have no system message."""
    if system_prompt is not None and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


# ------------------------------------------------------------------ rendering chats: the one path
#
# Every chat rlhpc tokenizes (data prompts, environments' and tools' observations, an agent's
# messages, what a reward model or judge reads) goes through ``render_marked`` and
# ``encode_marked``. Text that did not come from the template (messages, tool schemas, tool
# answers, the policy's replies) never becomes a control token: the control tokens in it are
# wrapped in two private-use characters before the template renders it, and each wrapped one is
# encoded as plain text. Text without control tokens is left alone, so a benign chat renders
# and encodes exactly as ``apply_chat_template`` does, at the same cost; one with them encodes as
# ``apply_chat_template(..., sanitize_control_tokens=True)`` does (tests check both).

MARK_START, MARK_END = "\U000f1a00", "\U000f1a01"  # private-use: no tokenizer gives them meaning


@dataclass
class Controls:
    """A tokenizer's control tokens for one template: its special tokens, its ``chat_control_tokens``,
    and its added tokens that the template's text contains (Qwen's ``<tool_call>``), as
    ``transformers``' ``sanitize_control_tokens`` counts them (a superset where the template's
    source holds an added token outside its literals: safe, it only marks more)."""

    tokens: tuple[str, ...]
    find: re.Pattern  # any control token, longest first
    pieces: re.Pattern  # a marked control token (its group), or a stray marker
    plain: dict[str, list[int]]  # a control token's ids as plain text, once computed


_CONTROLS: weakref.WeakKeyDictionary[Any, dict[str | None, Controls]] = weakref.WeakKeyDictionary()


def controls(tokenizer: Any, template: str | None) -> Controls:
    """The control tokens of ``tokenizer`` under ``template`` (None: its special tokens only)."""
    per = _CONTROLS.setdefault(tokenizer, {})
    if template not in per:
        listed = set(getattr(tokenizer, "chat_control_tokens", None) or ())
        tokens = tuple(
            sorted(
                {
                    t.content
                    for t in tokenizer.added_tokens_decoder.values()
                    if t.content
                    and (
                        t.special
                        or t.content in listed
                        or (template and not t.content.isspace() and t.content in template)
                    )
                },
                key=len,
                reverse=True,
            )
        )
        find = re.compile("|".join(map(re.escape, tokens)) or "(?!)")
        pieces = re.compile(f"{MARK_START}({find.pattern}){MARK_END}|[{MARK_START}{MARK_END}]")
        per[template] = Controls(tokens, find, pieces, {})
    return per[template]


def mark(obj: Any, c: Controls) -> Any:
    """``obj`` (a string, or messages / tool schemas: lists and dicts, keys included) with every
    control token in its strings wrapped in the markers, and any marker already there dropped (so
    none can be forged); the object itself where nothing changes (the usual case: no copy)."""
    if isinstance(obj, str):
        if MARK_START in obj or MARK_END in obj:
            obj = obj.replace(MARK_START, "").replace(MARK_END, "")
        return c.find.sub(lambda m: f"{MARK_START}{m.group()}{MARK_END}", obj) if c.find.search(obj) else obj
    if isinstance(obj, dict):
        out = {mark(k, c): mark(v, c) for k, v in obj.items()}
        return obj if _same_items(out, obj) else out
    if isinstance(obj, list | tuple):
        out_list = [mark(v, c) for v in obj]
        return obj if all(a is b for a, b in zip(out_list, obj)) else out_list
    return obj


def _same_items(a: dict, b: dict) -> bool:
    return all(ka is kb and va is vb for (ka, va), (kb, vb) in zip(a.items(), b.items()))


def unmark(text: str) -> str:
    """A marked rendering as the text it stands for."""
    return text.replace(MARK_START, "").replace(MARK_END, "") if MARK_START in text or MARK_END in text else text


def is_marked(text: str) -> bool:
    return MARK_START in text or MARK_END in text


def render_marked(
    tokenizer: Any,
    template: str,
    marked: list[list[dict]],
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
) -> list[str]:
    """Each of the ``marked`` chats (``mark``'s, as ``tools``) rendered by ``template``, in one
    ``apply_chat_template`` call (it renders them one by one, each to the text it renders alone,
    and pays its per-call work once). ``unmark`` gives the text, ``encode_marked`` the ids."""
    if not marked:
        return []
    extra = {"tools": tools} if tools else {}
    try:
        texts = tokenizer.apply_chat_template(
            marked, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception as e:  # jinja2's errors: a template that does not render these messages
        bad = next(
            (chat for chat in marked if not _renders(tokenizer, template, chat, add_generation_prompt, extra)),
            marked[0],
        )
        raise ConfigError(
            f"the chat template does not render the messages {unmark(str(bad))[:120]} ({type(e).__name__}: {e})",
            "fix data.chat_template (a Jinja file), or use the tokenizer's own (auto)",
        ) from e
    return list(texts)


def _renders(tokenizer: Any, template: str, chat: list[dict], add_generation_prompt: bool, extra: dict) -> bool:
    try:
        tokenizer.apply_chat_template(chat, chat_template=template, add_generation_prompt=add_generation_prompt,
                                      tokenize=False, **extra)  # fmt: skip
        return True
    except Exception:
        return False


def encode_marked(tokenizer: Any, template: str | None, texts: Sequence[str]) -> dict[str, list[int]]:
    """Each distinct text of ``texts`` (a marked rendering, or a tail of one) -> its ids, no special
    tokens added (the template writes its own): a text without marks in one tokenizer call for
    all, as ``apply_chat_template`` encodes it; a marked control token as plain text, and the text
    around it as ``transformers``' ``sanitize_control_tokens`` encodes it (each piece after a mark
    on its own, after a newline that is then dropped, so no SentencePiece prefix space is added)."""
    unique = list(dict.fromkeys(texts))
    plain_texts = [t for t in unique if not is_marked(t)]
    marked = [t for t in unique if is_marked(t)]
    c = controls(tokenizer, template) if marked else None
    splits = {t: c.pieces.split(t) for t in marked} if c is not None else {}
    # the pieces of marked texts that are encoded as usual: the first as it is, the others after a newline
    normal = [p for pieces in splits.values() for p in _normal_pieces(pieces)]
    want = list(dict.fromkeys([*plain_texts, *normal, *(["\n"] if marked else [])]))
    ids = dict(zip(want, tokenizer(want, add_special_tokens=False)["input_ids"])) if want else {}
    out = {t: list(ids[t]) for t in plain_texts}
    for t, pieces in splits.items():
        assert c is not None
        out[t] = _encode_pieces(tokenizer, c, pieces, ids)
    return out


def _normal_pieces(pieces: list[str | None]) -> list[str]:
    out = [pieces[0] or ""]
    for i, piece in enumerate(pieces[1:], start=1):
        if piece and i % 2 == 0:
            out += ["\n" + piece, piece]
    return out


def _encode_pieces(tokenizer: Any, c: Controls, pieces: list[str | None], ids: dict[str, list[int]]) -> list[int]:
    newline = ids["\n"]
    out = list(ids[pieces[0] or ""])
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue  # a stray marker: dropped (it still breaks the text where it was)
        if i % 2 == 1:  # a marked control token: plain text
            if piece not in c.plain:
                c.plain[piece] = _after_newline(_plain_ids(tokenizer, "\n" + piece), newline) or _plain_ids(
                    tokenizer, piece
                )
                if tokenizer.convert_tokens_to_ids(piece) in c.plain[piece]:
                    raise RlhpcError(
                        f"the tokenizer encodes the text {piece!r} as its control token even as plain text, so "
                        "rlhpc cannot keep it from acting as one",
                        "remove that text from the messages (or tool answers) given to the model",
                    )
            out += c.plain[piece]
        else:
            out += _after_newline(ids["\n" + piece], newline) or ids[piece]
    return out


def _after_newline(ids: list[int], newline: list[int]) -> list[int] | None:
    return list(ids[len(newline) :]) if ids[: len(newline)] == newline else None


def _plain_ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s ids without matching any added token, special or not: the tokenizer's own
    pipeline without its added vocabulary (no shared state switched, unlike ``split_special_tokens``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: split_special_tokens is a per-call argument there
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    splits = [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
    return [t.id for s in splits for t in backend.model.tokenize(s)]


def render_chats(
    tokenizer: Any,
    template: str,
    chats: list[list[dict]],
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
    images: ImageTokens | None = None,
) -> list[tuple[str, list[int]]]:
    """(text, ids) of each of ``chats``: marked (``mark``), ``render_marked``, ``encode_marked``.
    ``images``: chat i's ``<image>`` marks are image parts, each image's pad repeated as many
    times as it has tokens (``rlhpc.data.images``); its text keeps one pad per image."""
    c = controls(tokenizer, template)
    counts = images.counts if images is not None else [[] for _ in chats]
    chats = [with_image_parts(chat) if n else chat for chat, n in zip(chats, counts)]
    texts = render_marked(
        tokenizer, template, [mark(list(chat), c) for chat in chats], add_generation_prompt, mark(tools, c)
    )
    # the template's own pads only: a pad in the messages' text is marked, and stays text
    full = [expand_pads(t, images.pad, n, MARK_START) if images is not None and n else t for t, n in zip(texts, counts)]
    ids = encode_marked(tokenizer, template, full)
    return [(unmark(t), ids[f]) for t, f in zip(texts, full)]


@dataclass(frozen=True)
class ImageTokens:
    """The image tokens of chats to render: the model's image pad token, and per chat the token
    count of each of its images, in order (none: a chat without images)."""

    pad: str
    counts: list[list[int]]

    @classmethod
    def of(cls, tokenizer: Any, vision: Vision, images: list[list[ImageRef]]) -> ImageTokens:
        return cls(
            tokenizer.convert_ids_to_tokens(vision.image_token_id), [[vision.tokens(r) for r in i] for i in images]
        )


def render_chat(
    tokenizer: Any, template: str, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
) -> tuple[str, list[int]]:
    """(text, ids) of ``messages`` (``tools``: OpenAI tool schemas, for templates that list them):
    ``apply_chat_template``'s for text without control tokens, and never a control token from
    the messages' own text."""
    return render_chats(tokenizer, template, [messages], add_generation_prompt, tools)[0]


def encode_untrusted(tokenizer: Any, trusted: str, untrusted: str, add_special_tokens: bool = True) -> list[int]:
    """The ids of ``trusted + untrusted`` (a model without a chat template reads plain text), with
    the tokenizer's special tokens added, and none made from ``untrusted``'s text: as
    ``tokenizer(trusted + untrusted)`` where that text holds none."""
    c = controls(tokenizer, None)
    text = trusted + mark(untrusted, c)
    if not is_marked(text):
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    ids = encode_marked(tokenizer, None, [text])[text]
    if not add_special_tokens:
        return ids
    bare, full = tokenizer("x", add_special_tokens=False)["input_ids"], tokenizer("x")["input_ids"]
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), 0)
    return [*full[:at], *ids, *full[at + len(bare) :]]


def prepare_prompts(
    tokenizer: Any,
    data: DataConfig,
    limits: dict[str, int] | None,
    vision: Vision | None = None,
    single_turn: bool = True,
) -> PromptPrep:
    """A ``PromptPrep``: chat rows rendered (``render``), then the rows whose prompt is longer
    than ``limits[split]`` tokens dropped (one too long for the context would fail a whole
    rollout; dropping every row is an error naming the limit and the fix). ``vision``: a
    vision-language model's (rows with images are refused without one); a prompt's length
    counts its image tokens; multi-turn rollouts (not ``single_turn``) take none yet."""

    def prepare(split: str, rows: list[Row]) -> list[Row]:
        rows = as_rows(rows)
        check_images(rows, vision, single_turn)
        template = chat_template(data, tokenizer) if any(r.is_chat for r in rows) else None
        chats = [i for i, r in enumerate(rows) if r.is_chat]
        images = ImageTokens.of(tokenizer, vision, [rows[i].images for i in chats]) if vision is not None else None
        rendered = render_chats(tokenizer, template, [with_system(rows[i].messages, data.system_prompt) for i in chats],
                                add_generation_prompt=True, images=images) if chats else []  # fmt: skip
        ready = list(rows)
        for i, (text, ids) in zip(chats, rendered):
            ready[i] = rows[i].derive(prompt_text=text, prompt_ids=ids)
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


def check_images(rows: list[Row], vision: Vision | None, single_turn: bool = True) -> None:
    """Rows with images need a vision-language model, chat-message prompts (the template writes
    the image tokens) and single-turn rollouts."""
    with_images = [r for r in rows if r.images]
    if not with_images:
        return
    where = with_images[0].images[0].source
    if not single_turn:
        raise ConfigError(
            f"the data has images ({where}, ...), which multi-turn rollouts (rollout.env, tools, a generate "
            "function, an agent) cannot take yet",
            "run image data single-turn (docs/guides/multimodal.md)",
        )
    if vision is None:
        raise ConfigError(
            f"the data has images ({where}, ...) but the model takes none (its config.json has no vision_config)",
            "use a vision-language model (e.g. Qwen2.5-VL; model.tiny.architecture: qwen2_5_vl), or drop the images",
        )
    text = next((r for r in with_images if not r.is_chat), None)
    if text is not None:
        raise ConfigError(
            f"{text.images[0].source}: a row with images has a text prompt, which has no place for image tokens",
            'give its prompt as chat messages with <image> where each image goes: [{"role": "user", "content": "<image>..."}]',
        )
