"""SGLang's OpenAI-compatible HTTP protocol, the subset the CPU engine serves: routes, request fields, response fields.

Each request model is named after SGLang's pydantic model in
``sglang/srt/entrypoints/openai/protocol.py`` and declares the fields the CPU engine uses, with
SGLang's defaults. ``NO_EFFECT`` lists SGLang fields the engine takes only at values that change
nothing; any other field is refused by name (not silently dropped, as pydantic would: a CPU run
must not differ from a GPU run without saying so). The ``*_FIELDS`` sets are the keys our
responses write. tests/unit/test_sglang_protocol.py checks every name here against the wheel.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class OpenAIRoute:
    """SGLang's OpenAI-compatible routes (``http_server.py``)."""

    MODELS = "/v1/models"
    COMPLETIONS = "/v1/completions"
    CHAT_COMPLETIONS = "/v1/chat/completions"

    @classmethod
    def all(cls) -> dict[str, str]:
        return {k: v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str)}


class HarnessRoute:
    """SGLang's other routes that agent harnesses speak (``http_server.py``): OpenAI's Responses
    API and Anthropic's Messages API. rlhpc's agent endpoint serves them; the CPU engine does not."""

    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"

    @classmethod
    def all(cls) -> dict[str, str]:
        return {k: v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str)}


class _Request(BaseModel):
    # extra fields are kept to be checked against NO_EFFECT (see ``unsupported_fields``)
    model_config = ConfigDict(extra="allow")

    model: str | None = None  # any name is served by the one model (SGLang: its served name)
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    # SGLang's extension: the sampled token ids (and the prompt's) in each choice, for token-level training
    return_token_ids: bool = False
    user: str | None = None  # ignored, as SGLang does
    # the LoRA adapter to generate with, by name (``model: "BASE:ADAPTER"`` names it too, and wins)
    lora_path: str | list[str | None] | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs: int | None = None  # the number of top logprobs per token (0: the sampled token's only)
    top_k: int = -1


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False  # the native meta_info per choice (per-token weight versions)


class ResponsesRequest(BaseModel):
    """OpenAI's Responses API request (SGLang's ``ResponsesRequest``), the fields rlhpc's agent
    endpoint reads; the others are checked by ``unsupported_fields`` against ``RESPONSES_NO_EFFECT``."""

    model_config = ConfigDict(extra="allow")

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str | None = None
    previous_response_id: str | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    stop: str | list[str] | None = None  # SGLang's extension


# Responses fields taken at any value (they change no token: bookkeeping) or only at the values
# that change nothing.
RESPONSES_ANY = frozenset({"store", "metadata", "user", "service_tier", "parallel_tool_calls"})
RESPONSES_NO_EFFECT: dict[str, tuple[Any, ...]] = {
    "background": (False, None),
    "include": (None, []),
    "max_tool_calls": (None,),
    "reasoning": (None,),
    "text": (None, {"format": {"type": "text"}}),
    "top_logprobs": (0, None),
    "truncation": ("disabled", None),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
}


# SGLang fields accepted only at the values that leave the output as it is.
NO_EFFECT: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "min_p": (0, 0.0, None),
    "logit_bias": (None, {}),
    "echo": (False,),
    "best_of": (None, 1),
    "suffix": (None,),
    "response_format": (None, {"type": "text"}),
    "min_tokens": (0,),
    "regex": (None,),
    "ebnf": (None,),
    "json_schema": (None,),
    "stop_regex": (None, []),
    "return_hidden_states": (False,),
    "rid": (None,),
}

# Keys our responses write, by SGLang's response model.
MODEL_CARD_FIELDS = frozenset({"id", "object", "created", "owned_by", "root", "max_model_len"})
COMPLETION_RESPONSE_FIELDS = frozenset({"id", "object", "created", "model", "choices", "usage", "metadata"})
COMPLETION_CHOICE_FIELDS = frozenset(
    {"index", "text", "logprobs", "finish_reason", "matched_stop", "token_ids", "prompt_token_ids"}
)
CHAT_RESPONSE_FIELDS = COMPLETION_RESPONSE_FIELDS
CHAT_CHOICE_FIELDS = frozenset(
    {"index", "message", "logprobs", "finish_reason", "matched_stop", "prompt_token_ids", "response_token_ids"}
    | {"meta_info"}
)
CHAT_MESSAGE_FIELDS = frozenset({"role", "content", "tool_calls"})
TOOL_CALL_FIELDS = frozenset({"id", "index", "type", "function"})
FUNCTION_FIELDS = frozenset({"name", "arguments"})
COMPLETION_LOGPROBS_FIELDS = frozenset({"text_offset", "token_logprobs", "tokens", "top_logprobs"})
CHAT_TOKEN_LOGPROB_FIELDS = frozenset({"token", "bytes", "logprob", "top_logprobs"})
USAGE_FIELDS = frozenset({"prompt_tokens", "completion_tokens", "total_tokens"})
DELTA_FIELDS = frozenset({"role", "content", "tool_calls"})
STREAM_CHOICE_FIELDS = frozenset({"index", "delta", "text", "logprobs", "finish_reason", "matched_stop"})


# SGLang's refusal and its words (serving_chat._validate_request): a template in a request's
# chat_template_kwargs is code the engine would run (``{{ 'x' * 300000000 }}`` took 22.8 GB).
REQUEST_TEMPLATE_REFUSED = (
    "Request-supplied chat_template is not allowed. Start the server with --trust-request-chat-template to permit it."
)


def unsupported_fields(req: BaseModel) -> list[str]:
    """The body's fields the server neither uses nor may ignore, as ``name=value``."""
    extra = req.model_extra or {}
    if isinstance(req, ResponsesRequest):
        allowed, anything = RESPONSES_NO_EFFECT, RESPONSES_ANY
    else:
        allowed, anything = NO_EFFECT, frozenset()
    return [f"{k}={v!r}" for k, v in extra.items() if k not in anything and (k not in allowed or v not in allowed[k])]
