"""SGLang request bodies -> the CPU engine's work: /generate rows, sampling params, memory tags.

Field names and routes come from ``rlhpc.wire.protocol``; this module holds what the CPU
engine does with them: SGLang's batching and parallel-sampling rules, and which sampling params
it supports (the rest are refused, not ignored).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhpc.wire.protocol import MEMORY_TAGS, NO_EFFECT_VALUES, TOP_K_ALL, EngineError

USED = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "sampling_seed",
        "stop_token_ids",
        "stop",
        "ignore_eos",
        "skip_special_tokens",
        "no_stop_trim",
    }
)
HARMLESS = frozenset({"n", "spaces_between_special_tokens", "stream_interval", "custom_params"})
_ACCEPTED = USED | HARMLESS

MAX_STOP_COUNT = 32  # SGLang's limit on stop strings per request (sampling_params.py)
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs: a typo must not ask for the whole vocabulary per token
MAX_ROWS = 1 << 16  # rows of one /generate (a rollout: a few thousand): a typo in n must not eat the node
_UNSUPPORTED_INPUTS = ("input_embeds", "image_data", "video_data", "audio_data", "lora_path")
# /generate takes images (a vision-language model's) and LoRA adapters; /classify does not
_UNSUPPORTED_GENERATE = tuple(k for k in _UNSUPPORTED_INPUTS if k not in ("image_data", "lora_path"))


@dataclass
class Item:
    """One row of a /generate batch, normalised."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop_ids: set[int]
    return_logprob: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    stop_strs: list[str]
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # with return_logprob and >= 0: the prompt tokens' logprobs from there
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    images: list[str] = field(default_factory=list)  # the row's image_data entries (SGLang's forms)
    lora_path: str | None = None  # the LoRA adapter it generates with, by name (None: the base model)
    adapter: Any = None  # ... as the engine resolved it (rlhpc.engine_server.cpu.lora.Adapter)
    # return_routed_experts: the positions from routed_experts_start_len on; None: not asked
    routed_experts_start: int | None = None


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against."""

    vocab_size: int
    context_len: int
    eos_ids: frozenset[int]


def _per_item(value: Any, num: int, what: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != num:
            raise EngineError(f"{what} has {len(value)} entries for a batch of {num}")
        return value
    return [value] * num


def check_rows(num: int) -> None:
    """Refuse a batch of more than ``MAX_ROWS`` rows, before any is built."""
    if num > MAX_ROWS:
        raise EngineError(f"a batch of {num} rows (prompts x n) is more than the CPU engine takes at once ({MAX_ROWS})")


def _inputs(
    body: dict[str, Any], limits: ModelLimits, encode: Callable[[str], list[int]]
) -> tuple[list[list[int]], bool]:
    """The token ids of each input (``text`` or ``input_ids``, one or a batch), checked against
    the model; and whether it was a single input (answered with a dict, not a list)."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise EngineError("Either text or input_ids should be provided.")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise EngineError("input_ids cannot be empty.")
        single = isinstance(input_ids[0], int)
        prompts = [input_ids] if single else input_ids
        check_rows(len(prompts))  # /classify had no cap at all
    else:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise EngineError("text must be a string or a list of strings")
        check_rows(len(texts))  # before one of them is encoded
        prompts = [encode(t) for t in texts]
    for p in prompts:
        if not isinstance(p, list) or not p or not all(isinstance(t, int) for t in p):
            raise EngineError("every prompt must be a non-empty list of token ids")
        if min(p) < 0 or max(p) >= limits.vocab_size:
            raise EngineError(f"token id out of range [0, {limits.vocab_size})")
        if len(p) >= limits.context_len:
            raise EngineError(f"prompt of {len(p)} tokens does not fit the context length {limits.context_len}")
    return prompts, single


def normalize_classify(
    body: dict[str, Any], limits: ModelLimits, encode: Callable[[str], list[int]]
) -> tuple[list[list[int]], bool]:
    """EmbeddingReqInput (/classify) -> (the token ids of each input, whether it was a single one)."""
    for unsupported in _UNSUPPORTED_INPUTS:
        if body.get(unsupported) is not None:
            raise EngineError(f"{unsupported} is not supported by the CPU engine")
    return _inputs(body, limits, encode)


def normalize_generate(
    body: dict[str, Any], limits: ModelLimits, encode: Callable[[str], list[int]]
) -> tuple[list[Item], bool]:
    """GenerateReqInput -> (rows, whether the answer is a single dict), following SGLang's
    batching and parallel-sampling rules."""
    for unsupported in _UNSUPPORTED_GENERATE:
        if body.get(unsupported) is not None:
            raise EngineError(f"{unsupported} is not supported by the CPU engine")
    if body.get("stream"):
        raise EngineError("stream=true is not supported by the CPU engine")
    prompts, single = _inputs(body, limits, encode)
    one_prompt = single  # before n > 1 makes the answer a list

    params = body.get("sampling_params")
    params = {} if params is None else params
    batch_size = len(prompts)
    if isinstance(params, list):
        if not params or not all(isinstance(p, dict) for p in params):
            raise EngineError("sampling_params must be a dict or a list of dicts")
        ns = {_number(p, "n", 1, int) for p in params}
        if len(ns) != 1:
            raise EngineError("The parallel_sample_num should be the same for all samples in sample params.")
        n = ns.pop()
    elif isinstance(params, dict):
        n = _number(params, "n", 1, int)
    else:
        raise EngineError("sampling_params must be a dict or a list of dicts")
    if n < 1:
        raise EngineError(f"n must be at least 1, got {n}")
    if n > 1 and single:
        single = False
    num = batch_size * n
    check_rows(num)
    # SGLang repeats the whole batch n times: [p0, p1, p0, p1, ...]
    prompts = prompts * n
    param_list = [params] * num if isinstance(params, dict) else _per_item(params, batch_size, "sampling_params") * n
    logprob_flags = _per_item(body.get("return_logprob") or False, batch_size, "return_logprob") * n
    tops = [_top_logprobs_num(k) for k in _per_item(body.get("top_logprobs_num") or 0, batch_size, "top_logprobs_num")]

    rid = body.get("rid")
    if not (rid is None or isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))):
        raise EngineError(f"rid must be a string or a list of strings, got {type(rid).__name__}")
    if single:
        rids = [rid if isinstance(rid, str) else uuid.uuid4().hex]
    elif rid is None:  # unique as SGLang's uuid4 per row; one uuid per request is cheaper (256 rows: 0.5 ms)
        base = uuid.uuid4().hex
        rids = [f"{base}-{i}" for i in range(num)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(num)]
    else:
        base = _per_item(rid, batch_size, "rid")
        rids = base if n == 1 else [f"{r}_{k}" for k in range(n) for r in base]
    items = [_item(r, p, sp, bool(lp), limits) for r, p, sp, lp in zip(rids, prompts, param_list, logprob_flags)]
    starts = _per_item(
        -1 if body.get("logprob_start_len") is None else body["logprob_start_len"], batch_size, "logprob_start_len"
    )
    for it, images in zip(items, image_rows(body.get("image_data"), batch_size, one_prompt) * n):
        it.images = images
    for it, name in zip(items, lora_rows(body.get("lora_path"), batch_size) * n):
        it.lora_path = name
    if body.get("return_routed_experts"):  # one value for the whole batch, as SGLang's
        start = body.get("routed_experts_start_len", 0)
        for it in items:
            it.routed_experts_start = _routed_experts_start(start, len(it.prompt))
    for it, lp, k, start in zip(items, logprob_flags, tops * n, starts * n):
        it.top_logprobs_num = k if lp else 0  # SGLang reports top logprobs only with return_logprob
        it.logprob_start_len = _logprob_start(start, len(it.prompt)) if lp else -1
    return items, single


def image_rows(image_data: Any, batch_size: int, single: bool) -> list[list[str]]:
    """Each prompt's images, as SGLang's ``GenerateReqInput._normalize_image_data`` reads
    ``image_data``: None or [] (none), one image (every prompt's), a list of one per prompt, or a
    list of lists; with its message when the length is not the batch's."""
    if image_data is None or image_data == []:
        return [[] for _ in range(batch_size)]
    if not isinstance(image_data, list):
        return [[image_data] for _ in range(batch_size)]
    if single and not isinstance(image_data[0], list):  # one prompt, its images listed
        image_data = [image_data]
    if len(image_data) != batch_size:  # SGLang's words
        raise EngineError("The length of image_data should be equal to the batch size.")
    if isinstance(image_data[0], list):
        return [[] if row is None or row == [None] else list(row) for row in image_data]
    return [[img] for img in image_data]


def lora_rows(lora_path: Any, batch_size: int) -> list[str | None]:
    """Each prompt's adapter name, as SGLang's ``GenerateReqInput._normalize_lora_paths`` reads
    ``lora_path``: one name for every prompt, or a list of one per prompt (None: the base model)."""
    if lora_path is None or isinstance(lora_path, str):
        return [lora_path or None] * batch_size
    if not isinstance(lora_path, list) or not all(p is None or isinstance(p, str) for p in lora_path):
        raise EngineError("lora_path should be a list or a string.")  # SGLang's words
    return [p or None for p in _per_item(lora_path, batch_size, "lora_path")]


def _logprob_start(start: Any, prompt_len: int) -> int:
    if not isinstance(start, int) or isinstance(start, bool) or start < -1:
        raise EngineError(f"logprob_start_len must be -1 or a prompt position, got {start!r}")
    if start >= prompt_len:  # SGLang's words (Scheduler)
        raise EngineError(
            f"req.logprob_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt_len}. Please use a smaller logprob_start_len."
        )
    return start


def _routed_experts_start(start: Any, prompt_len: int) -> int:
    """SGLang's check of ``routed_experts_start_len`` (its Scheduler aborts such a request)."""
    if not isinstance(start, int) or isinstance(start, bool):
        raise EngineError(f"routed_experts_start_len must be an integer, got {start!r}")
    if start < 0:  # SGLang's words
        raise EngineError(
            f"recv_req.routed_experts_start_len={start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    if start > prompt_len:
        raise EngineError(
            f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt_len}. Please use a smaller routed_experts_start_len."
        )
    return start


def _top_logprobs_num(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise EngineError(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
    return k


def stop_strings(value: Any) -> list[str]:
    """SGLang's ``stop``: None, one string or a list of them. An empty string is refused: SGLang
    would find it in any text and end every generation at its first token."""
    strs = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(strs, list) or not all(isinstance(s, str) for s in strs):
        raise EngineError(f"stop must be a string or a list of strings, got {value!r}")
    if len(strs) > MAX_STOP_COUNT:  # SGLang's words
        raise EngineError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(strs)}")
    if "" in strs:
        raise EngineError("stop strings must not be empty (an empty one matches any text); leave it out")
    return strs


def _item(rid: str, prompt: list[int], sp: dict[str, Any], return_logprob: bool, limits: ModelLimits) -> Item:
    for key, value in sp.items() if not _ACCEPTED.issuperset(sp) else ():  # the usual case skips the loop
        if key in _ACCEPTED or value is None:
            continue
        if key in NO_EFFECT_VALUES:
            if value not in NO_EFFECT_VALUES[key]:
                raise EngineError(f"sampling param {key}={value!r} is not supported by the CPU engine")
            continue
        raise EngineError(f"unknown sampling param {key!r}")
    temperature = _number(sp, "temperature", 1.0, float)
    top_p = _number(sp, "top_p", 1.0, float)
    top_k = _number(sp, "top_k", -1, int)
    min_p = _number(sp, "min_p", 0.0, float)
    repetition_penalty = _number(sp, "repetition_penalty", 1.0, float)
    if not math.isfinite(temperature) or temperature < 0:  # SGLang's words (SamplingParams.verify)
        raise EngineError(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0 < top_p <= 1:
        raise EngineError(f"top_p must be in (0, 1], got {top_p}.")
    if top_k < 1 and top_k != -1:
        raise EngineError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if not 0 <= min_p <= 1:
        raise EngineError(f"min_p must be in [0, 1], got {min_p}.")
    if not 0 < repetition_penalty <= 2:
        raise EngineError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition_penalty}.")
    if top_k == 1 or temperature < 1e-6:  # SGLang: both mean greedy
        temperature = 0.0
    room = limits.context_len - len(prompt)
    max_new = (
        room if "max_new_tokens" in sp and sp["max_new_tokens"] is None else _number(sp, "max_new_tokens", 128, int)
    )
    if max_new < 0:
        raise EngineError(f"max_new_tokens must be at least 0, got {max_new}.")
    if max_new > room:  # SGLang's check and words (TokenizerManager._validate_one_request)
        raise EngineError(
            f"Requested token count exceeds the model's maximum context length of {limits.context_len} tokens. "
            f"You requested a total of {len(prompt) + max_new} tokens: {len(prompt)} tokens from the input messages "
            f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input messages or "
            "the completion to fit within the limit."
        )
    stops = set() if sp.get("ignore_eos") else set(limits.eos_ids)
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise EngineError(f"stop_token_ids must be a list of token ids, got {stop_ids!r}")
    stops.update(stop_ids)
    seed = _number(sp, "sampling_seed", None, int)
    return Item(
        rid=rid,
        prompt=prompt,
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        seed=None if seed is None else int(seed),
        stop_ids=stops,
        return_logprob=return_logprob,
        skip_special_tokens=sp.get("skip_special_tokens", True) is not False,
        no_stop_trim=bool(sp.get("no_stop_trim")),
        stop_strs=stop_strings(sp.get("stop")),
        top_k=TOP_K_ALL if top_k == -1 else top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
    )


def _number(sp: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    """A numeric sampling param: JSON numbers only (``"nan"`` or ``true`` is refused, not coerced)."""
    value = sp.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise EngineError(f"sampling param {key} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
    return kind(value)


def check_tags(tags: list[str] | None) -> list[str]:
    """release/resume_memory_occupation tags; None means all."""
    if tags is None:
        return list(MEMORY_TAGS)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise EngineError(f"unknown memory tag(s) {bad}; use {list(MEMORY_TAGS)}")
    return list(tags)
