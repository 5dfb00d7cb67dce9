"""SGLang's native HTTP protocol, written once: routes, request bodies, sampling params, meta_info keys.

The client (``rlhpc.wire.client``) builds its request bodies from these dataclasses and the
CPU engine server (``rlhpc.engine_server.cpu``) validates them with the same ones, so both speak
SGLang's names. Each class is named after SGLang's request struct in
``sglang/srt/managers/io_struct.py`` and holds the subset of its fields rlhpc uses, with SGLang's
defaults; fields without a default are required there too. tests/unit/test_sglang_protocol.py
checks every name here against the sources of the SGLang wheel we support.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass
from typing import Any

from rlhpc.errors import RlhpcError

SGLANG_VERSION = "0.5.23"  # the release these names are pinned against (Makefile downloads its wheel)

SGLANG_GROUP_NAME = "weight_update_group"  # SGLang's default weight-update group name
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # release/resume_memory_occupation tags (None: all)
PAUSE_MODES = ("abort", "retract", "in_place")
WEIGHT_VERSION_SPAN_KEYS = ("version", "start", "end")  # one entry of meta_info["weight_versions"]
WEIGHT_UPDATE_SELECTORS = ("target", "draft", "all")  # which model runners a weight-update session opens
TOP_K_ALL = 1 << 30  # SGLang's "no top-k"
# load_format of /update_weights_from_distributed: ONE broadcast per bucket, the tensors' bytes
# back to back (SGLang's FlattenedTensorBucket layout; see rlhpc.weights.tensor_transport)
FLATTENED_BUCKET = "flattened_bucket"
# Rollout routing replay (R3): the launch flag without which SGLang answers no routed experts
# (it ignores the request's return_routed_experts then, without an error)
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
# rollout.quantization: fp8: SGLang's launch flag and the quantization a block-FP8 checkpoint's
# config.json names (quantization_config.quant_method; Fp8Config.from_config)
QUANTIZATION_FLAG = "--quantization"
FP8_QUANTIZATION = "fp8"


class Route:
    """The routes rlhpc calls (and the CPU engine serves), as in SGLang's ``http_server.py``."""

    HEALTH = "/health"
    HEALTH_GENERATE = "/health_generate"
    MODEL_INFO = "/model_info"
    MODEL_INFO_OLD = "/get_model_info"  # deprecated in SGLang, still served
    SERVER_INFO = "/server_info"
    SERVER_INFO_OLD = "/get_server_info"  # deprecated in SGLang, still served
    GENERATE = "/generate"
    # A reward model's scores (a *ForSequenceClassification model; SGLang serves it as an
    # embedding model: the answer's "embedding" holds the num_labels scores of the last token)
    CLASSIFY = "/classify"
    FLUSH_CACHE = "/flush_cache"  # no body
    PAUSE_GENERATION = "/pause_generation"
    CONTINUE_GENERATION = "/continue_generation"
    ABORT_REQUEST = "/abort_request"
    INIT_WEIGHTS_UPDATE_GROUP = "/init_weights_update_group"
    DESTROY_WEIGHTS_UPDATE_GROUP = "/destroy_weights_update_group"
    # SGLang refuses both updates outside a session opened by BEGIN and closed by END
    BEGIN_WEIGHT_UPDATE = "/begin_weight_update"
    END_WEIGHT_UPDATE = "/end_weight_update"
    UPDATE_WEIGHTS_FROM_DISTRIBUTED = "/update_weights_from_distributed"
    UPDATE_WEIGHTS_FROM_TENSOR = "/update_weights_from_tensor"
    UPDATE_WEIGHT_VERSION = "/update_weight_version"  # the version alone (after a busy flush, see FLUSH_BUSY)
    GET_WEIGHTS_BY_NAME = "/get_weights_by_name"
    RELEASE_MEMORY_OCCUPATION = "/release_memory_occupation"
    RESUME_MEMORY_OCCUPATION = "/resume_memory_occupation"
    # LoRA adapters, held by name (an engine started with --enable-lora; see rlhpc.wire.lora)
    LOAD_LORA_ADAPTER = "/load_lora_adapter"  # from a PEFT directory the engine reads
    LOAD_LORA_ADAPTER_FROM_TENSORS = "/load_lora_adapter_from_tensors"  # pushed, as weights are
    UNLOAD_LORA_ADAPTER = "/unload_lora_adapter"

    @classmethod
    def all(cls) -> dict[str, str]:
        """Attribute name -> route."""
        return {k: v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str)}


# ------------------------------------------------------------------ request bodies


@dataclass
class GenerateReqInput:
    """Exactly one of ``input_ids`` / ``text``; one prompt or a batch (lists per prompt)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    # With return_logprob: the first prompt position whose token's logprob is answered (under
    # meta_info.input_token_logprobs); None (SGLang: -1): the output tokens' alone. SGLang answers
    # None for the token at this position, so a teacher asks from the one before the response.
    logprob_start_len: int | list[int] | None = None
    rid: str | list[str] | None = None
    # A vision-language model's images: one per prompt, or a list per prompt (SGLang's batch
    # form), each a data URI ("data:image/png;base64,..."), base64, or a path on the engine's node.
    # The prompt holds the model's image tokens already (the driver rendered them); SGLang
    # processes the images again and checks they fill those tokens.
    image_data: list[list[str]] | list[str] | str | None = None
    # The LoRA adapter each prompt generates with, by the name it was loaded under (None: the
    # base model); one name for every prompt, or one per prompt
    lora_path: list[str | None] | str | None = None
    # A MoE model's routing (R3): answer each token's top-k experts per layer in
    # meta_info["routed_experts"] (``routed_experts``); only on an engine started with
    # ROUTED_EXPERTS_FLAG. One value for every prompt of a batch.
    return_routed_experts: bool = False


@dataclass
class EmbeddingReqInput:
    """/classify's body: exactly one of ``input_ids`` / ``text``; one input or a batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None


# The key of a /classify answer's scores (one answer per input: {"embedding": [...], "meta_info"})
EMBEDDING = "embedding"


@dataclass
class PauseGenerationReqInput:
    mode: str = "abort"  # one of PAUSE_MODES


@dataclass
class ContinueGenerationReqInput:
    pass  # SGLang's only field (torch_empty_cache) keeps its default


@dataclass
class AbortReq:
    rid: str | None = ""
    abort_all: bool = False


@dataclass
class InitWeightsUpdateGroupReqInput:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = SGLANG_GROUP_NAME
    backend: str = "nccl"


@dataclass
class DestroyWeightsUpdateGroupReqInput:
    group_name: str = SGLANG_GROUP_NAME


@dataclass
class BeginWeightUpdateReqInput:
    selector: str = "all"  # one of WEIGHT_UPDATE_SELECTORS


@dataclass
class EndWeightUpdateReqInput:
    pass  # SGLang's has no fields


@dataclass
class UpdateWeightsFromDistributedReqInput:
    """``dtypes`` as torch attribute names ("float32", "bfloat16"); tensors are broadcast in ``names`` order,
    one broadcast each, or (``load_format=FLATTENED_BUCKET``) as one flat uint8 broadcast."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = SGLANG_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


@dataclass
class UpdateWeightsFromTensorReqInput:
    """One base64 entry per TP rank (see ``rlhpc.weights.tensor_transport``)."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass
class UpdateWeightVersionReqInput:
    new_version: str
    abort_all_requests: bool = True


@dataclass
class GetWeightsByNameReqInput:
    name: str
    truncate_size: int = 100


@dataclass
class ReleaseMemoryOccupationReqInput:
    tags: list[str] | None = None  # None: all of MEMORY_TAGS


@dataclass
class ResumeMemoryOccupationReqInput:
    tags: list[str] | None = None  # None: all of MEMORY_TAGS


@dataclass
class LoadLoRAAdapterReqInput:
    """An adapter from ``lora_path``, a PEFT directory (adapter_config.json and the adapter's
    safetensors) on the engine's node, held as ``lora_name``."""

    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass
class LoadLoRAAdapterFromTensorsReqInput:
    """An adapter pushed: its PEFT config (``config_dict``, adapter_config.json's content) and its
    tensors, one base64 payload per TP rank serialized as a weight push's
    (``rlhpc.weights.tensor_transport.serialize_tensor_dict``: {PEFT name: tensor}, or with
    ``load_format=FLATTENED_BUCKET`` a flattened bucket)."""

    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    pinned: bool = False
    load_format: str | None = None


@dataclass
class UnloadLoRAAdapterReqInput:
    lora_name: str


@dataclass
class LoRAUpdateOutput:
    """The answer of the three adapter routes (HTTP 200 when ``success``, else 400): the adapters
    loaded after the call, name -> the path each was loaded from (``TENSOR_LORA_PATH`` if pushed)."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None


# Which body each route takes (routes absent here take none, or a body of their own shape).
ROUTE_BODIES: dict[str, type] = {
    Route.GENERATE: GenerateReqInput,
    Route.CLASSIFY: EmbeddingReqInput,
    Route.PAUSE_GENERATION: PauseGenerationReqInput,
    Route.CONTINUE_GENERATION: ContinueGenerationReqInput,
    Route.ABORT_REQUEST: AbortReq,
    Route.INIT_WEIGHTS_UPDATE_GROUP: InitWeightsUpdateGroupReqInput,
    Route.DESTROY_WEIGHTS_UPDATE_GROUP: DestroyWeightsUpdateGroupReqInput,
    Route.BEGIN_WEIGHT_UPDATE: BeginWeightUpdateReqInput,
    Route.END_WEIGHT_UPDATE: EndWeightUpdateReqInput,
    Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED: UpdateWeightsFromDistributedReqInput,
    Route.UPDATE_WEIGHTS_FROM_TENSOR: UpdateWeightsFromTensorReqInput,
    Route.UPDATE_WEIGHT_VERSION: UpdateWeightVersionReqInput,
    Route.GET_WEIGHTS_BY_NAME: GetWeightsByNameReqInput,
    Route.RELEASE_MEMORY_OCCUPATION: ReleaseMemoryOccupationReqInput,
    Route.RESUME_MEMORY_OCCUPATION: ResumeMemoryOccupationReqInput,
    Route.LOAD_LORA_ADAPTER: LoadLoRAAdapterReqInput,
    Route.LOAD_LORA_ADAPTER_FROM_TENSORS: LoadLoRAAdapterFromTensorsReqInput,
    Route.UNLOAD_LORA_ADAPTER: UnloadLoRAAdapterReqInput,
}


# SGLang's answers (success=false, HTTP 400) to a weight update outside a session, a second
# begin, and an end without a begin (sglang/srt/managers/scheduler_components/weight_updater.py)
def outside_session_message(route: str) -> str:
    """``route``: Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED or Route.UPDATE_WEIGHTS_FROM_TENSOR."""
    return f"{route.lstrip('/')} must run between begin_weight_update() and end_weight_update()"


SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_OPEN = "no weight-update session is open; call begin_weight_update() first"
# An update asked to flush the cache (the last bucket) with requests running or queued: SGLang
# loads the weights but answers success=false with this, and records no new version
# (weight_updater.flush_cache_after_weight_update); /flush_cache then answers 400 until it is idle.
FLUSH_BUSY = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)
FLUSH_FAILED = "Flush cache failed.\n"  # /flush_cache's 400 body while requests run (http_server.flush_cache)


def weight_version_note(version: str) -> str:
    """What SGLang appends to a weight update's success message once it has set ``weight_version``
    (so the answer itself confirms the version, without asking again)."""
    return f" Weight version updated to {version}."


def is_batch(req: GenerateReqInput) -> bool:
    """A list of prompts (token-id lists or strings), not one prompt."""
    if req.text is not None:
        return isinstance(req.text, list)
    return bool(req.input_ids) and isinstance(req.input_ids[0], list)


def per_prompt(req: GenerateReqInput) -> list[GenerateReqInput]:
    """A /generate request as one request per prompt, each with its own sampling params, rid,
    return_logprob and logprob_start_len; a field given once applies to every prompt (a string
    rid becomes ``RID_i``), as SGLang normalizes a batch (``GenerateReqInput.normalize_batch_and_arguments``)."""
    if not is_batch(req):
        return [req]
    prompts = req.text if req.text is not None else req.input_ids
    n = len(prompts)

    def pick(value: Any, i: int) -> Any:
        return value[i] if isinstance(value, list) else value

    for name in ("sampling_params", "return_logprob", "logprob_start_len", "rid", "image_data", "lora_path"):
        value = getattr(req, name)
        if isinstance(value, list) and len(value) != n:
            raise RlhpcError(
                f"a /generate of {n} prompts with {len(value)} {name}", f"give {name} once, or once per prompt"
            )
    return [
        GenerateReqInput(
            text=prompts[i] if req.text is not None else None,
            input_ids=prompts[i] if req.text is None else None,
            sampling_params=dict(pick(req.sampling_params, i) or {}),
            return_logprob=pick(req.return_logprob, i),
            logprob_start_len=pick(req.logprob_start_len, i),
            rid=f"{req.rid}_{i}" if isinstance(req.rid, str) else pick(req.rid, i),
            image_data=req.image_data[i] if req.image_data is not None else None,  # a batch's: one entry a prompt
            lora_path=pick(req.lora_path, i),
            return_routed_experts=req.return_routed_experts,
        )
        for i in range(n)
    ]


# ------------------------------------------------------------------ sglang_router

ROUTER_VERSION = "0.3.2"  # the sglang-router release the router's behaviour below is pinned against
# The router's own route answering how many of its engines it routes to now: its /health answers
# before it has registered them (it registers them in the background).
ROUTER_READINESS = "/readiness"

# sglang_router parses a /generate body into a request type of its own and sends the engine that,
# serialized again: one sampling-params dict, one rid string, one return_logprob (a batch with a
# list of either is answered 422), and of the sampling params only those it knows. rlhpc sends
# it one prompt per request (``per_prompt``): per-sample seeds reach the engine, and the engines
# batch the requests as they arrive (SGLang's scheduler does; tests/integration/test_router.py
# compares what an engine receives with what was sent). These sampling params never arrive:
ROUTER_DROPPED_SAMPLING_PARAMS = frozenset(
    {"stop_regex", "structural_tag", "logit_bias", "spaces_between_special_tokens", "stream_interval", "custom_params"}
)
# ... at these values, dropping one changes nothing (SGLang's defaults; stream_interval paces a
# stream, and rlhpc never streams from an engine)
_DROPPED_HARMLESS: dict[str, tuple[Any, ...]] = {
    "stop_regex": (None, "", []),
    "structural_tag": (None, ""),
    "logit_bias": (None, {}),
    "spaces_between_special_tokens": (None, True),
    "custom_params": (None, {}),
}


def lost_through_router(sampling_params: dict[str, Any]) -> list[str]:
    """The sampling params the router would drop at a value that changes what the engine does."""
    return sorted(
        k
        for k, v in sampling_params.items()
        if k in ROUTER_DROPPED_SAMPLING_PARAMS and k in _DROPPED_HARMLESS and v not in _DROPPED_HARMLESS[k]
    )


def body(req: Any, drop_none: tuple[str, ...] = ()) -> dict[str, Any]:
    """A request dataclass as its JSON body; fields named in ``drop_none`` are left out when None."""
    # not dataclasses.asdict: it deep-copies every list (token ids, base64 tensor payloads)
    return {
        f.name: getattr(req, f.name)
        for f in dataclasses.fields(req)
        if not (f.name in drop_none and getattr(req, f.name) is None)
    }


def generate_body(req: GenerateReqInput) -> dict[str, Any]:
    """A /generate request's body: the prompt field not given, an unset rid or logprob_start_len,
    and return_routed_experts unless asked, are left out (SGLang's own defaults apply)."""
    out = body(req, drop_none=("text", "input_ids", "rid", "logprob_start_len", "image_data", "lora_path"))
    if not req.return_routed_experts:  # SGLang's default: bodies stay as they were before R3
        del out["return_routed_experts"]
    return out


# ------------------------------------------------------------------ sampling params and outputs

# SGLang's SamplingParams API fields that rlhpc sends or the CPU engine accepts.
SAMPLING_PARAMS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "sampling_seed",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "no_stop_trim",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "stop",
        "stop_regex",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "logit_bias",
        "n",
        "spaces_between_special_tokens",
        "stream_interval",
        "custom_params",
    }
)

# The values at which a sampling param leaves the token distribution as it is (SGLang's defaults).
NO_EFFECT_VALUES: dict[str, tuple[Any, ...]] = {
    "min_p": (0.0,),
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "min_new_tokens": (0,),
    "stop_regex": ([], ""),
    "json_schema": (),
    "regex": (),
    "ebnf": (),
    "structural_tag": (),
    "logit_bias": ({},),
}


class MetaInfo:
    """Keys of a /generate output's ``meta_info`` that rlhpc reads or the CPU engine writes."""

    ID = "id"
    FINISH_REASON = "finish_reason"  # {"type": "stop", "matched"} | {"type": "length", "length"} | {"type": "abort"}
    PROMPT_TOKENS = "prompt_tokens"
    COMPLETION_TOKENS = "completion_tokens"
    CACHED_TOKENS = "cached_tokens"
    WEIGHT_VERSION = "weight_version"  # of the last output token (SGLang: the newest span's)
    # Per-token versions as spans [{"version", "start", "end"}, ...] over the output tokens: more
    # than one when a generation went on across a weight update (pause in place/retract, continue)
    WEIGHT_VERSIONS = "weight_versions"
    E2E_LATENCY = "e2e_latency"
    OUTPUT_TOKEN_LOGPROBS = "output_token_logprobs"  # [[logprob, token id, text or None], ...]
    # with logprob_start_len: per prompt token from there, [[logprob, token id, text or None], ...];
    # the first entry's logprob is None
    INPUT_TOKEN_LOGPROBS = "input_token_logprobs"
    OUTPUT_TOP_LOGPROBS = "output_top_logprobs"  # per output token: its top_logprobs_num [[logprob, id, text], ...]
    # with return_routed_experts: base64 of the int32 array [prompt + output tokens - 1, layers,
    # experts per token] (C order), each position's top-k expert ids (``routed_experts``)
    ROUTED_EXPERTS = "routed_experts"

    @classmethod
    def all(cls) -> frozenset[str]:
        return frozenset(v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str))


class EngineError(Exception):
    """A request the engine refuses; answered as HTTP 400 with SGLang's error body."""


# Sampling parameters by how the CPU engine treats them. Those in NO_EFFECT_VALUES and not USED
# are accepted only at those values (anything else changes the distribution, and silently
# ignoring it would make CPU and GPU runs differ).


# ------------------------------------------------------------------ reading meta_info


def weight_version(meta_info: dict) -> int:
    """The weight version an engine reports in a sample's meta_info, as the int the driver pushed
    (0 for an engine still on the weights on disk: SGLang calls that version "default")."""
    version = meta_info.get(MetaInfo.WEIGHT_VERSION)
    try:
        return int(version)
    except (TypeError, ValueError):
        return 0


def token_versions(meta_info: dict, num_tokens: int) -> list[int]:
    """The weight version of each of a sample's ``num_tokens`` output tokens, from SGLang's
    ``weight_versions`` spans (``[{"version", "start", "end"}, ...]``); without them (or when they do
    not cover the tokens) every token has the sample's ``weight_version``."""
    version_key, start_key, end_key = WEIGHT_VERSION_SPAN_KEYS
    spans = meta_info.get(MetaInfo.WEIGHT_VERSIONS)
    out: list[int] = []
    try:
        for sp in spans if isinstance(spans, list) else ():
            version = weight_version({MetaInfo.WEIGHT_VERSION: sp[version_key]})
            out += [version] * (int(sp[end_key]) - int(sp[start_key]))
    except (KeyError, TypeError, ValueError):
        out = []
    return out if len(out) == num_tokens and out else [weight_version(meta_info)] * num_tokens


def finish_reason(meta_info: dict) -> str | None:
    reason = meta_info.get(MetaInfo.FINISH_REASON)
    return reason.get("type") if isinstance(reason, dict) else reason


# ------------------------------------------------------------------ routed experts (R3)


def encode_routed_experts(experts: Any) -> str:
    """An int array [positions, layers, top-k] as SGLang answers it: base64 of its int32 bytes."""
    import numpy as np

    return base64.b64encode(np.ascontiguousarray(experts, dtype="<i4").tobytes()).decode("ascii")


def routed_experts(meta_info: dict, positions: int, layers: int, top_k: int) -> Any:
    """A sample's ``meta_info["routed_experts"]`` as an int array [positions, layers, top_k]:
    position t's top-k expert ids in each layer, for the ``positions`` = prompt + output tokens
    - 1 that went through the model (the last token never did). Raises ``RlhpcError`` when it is
    missing or of another size (an engine started without ROUTED_EXPERTS_FLAG answers none)."""
    import numpy as np

    raw = meta_info.get(MetaInfo.ROUTED_EXPERTS)
    if not isinstance(raw, str):
        raise RlhpcError(
            f"an engine answered no meta_info[{MetaInfo.ROUTED_EXPERTS!r}] for a request with return_routed_experts",
            f"start the engines with {ROUTED_EXPERTS_FLAG} (algo.routing_replay does) and send the requests "
            "to them directly (rollout.sglang.router: false)",
        )
    flat = np.frombuffer(base64.b64decode(raw), dtype="<i4")
    if flat.size != positions * layers * top_k:
        raise RlhpcError(
            f"meta_info[{MetaInfo.ROUTED_EXPERTS!r}] holds {flat.size} expert ids, not {positions} positions x "
            f"{layers} layers x {top_k} experts per token",
            "serve the same model the actor trains (its num_hidden_layers and num_experts_per_tok)",
        )
    return flat.reshape(positions, layers, top_k)
