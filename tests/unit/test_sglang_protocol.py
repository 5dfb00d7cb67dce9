"""rlhpc's SGLang protocol and launch flags against SGLang's own sources (the wheel the Makefile downloads).

Nothing is imported from SGLang and no GPU is needed: tests/support/sglang_wheel.py parses the
wheel's sources. A renamed or removed field, route, sampling param or flag in SGLang fails here.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import sglang_wheel as sgl

from rlhpc.engine_server import sglang as sglang_server
from rlhpc.engine_server.cpu import requests as cpu_requests
from rlhpc.engine_server.sglang import SGLangSpec
from rlhpc.errors import RlhpcError
from rlhpc.wire import anthropic_messages as AM
from rlhpc.wire import lora as L
from rlhpc.wire import openai_protocol as OP
from rlhpc.wire import protocol as P
from rlhpc.wire.openai_protocol import OpenAIRoute
from rlhpc.wire.protocol import Route

BODIES = sorted(set(P.ROUTE_BODIES.values()), key=lambda c: c.__name__)


def _required(cls: type) -> set[str]:
    return {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }


def test_the_wheel_is_the_supported_version() -> None:
    assert sgl.wheel_path().name.startswith(f"sglang-{P.SGLANG_VERSION}-")


# ------------------------------------------------------------------ request bodies


@pytest.mark.parametrize("cls", BODIES, ids=lambda c: c.__name__)
def test_request_fields_exist_in_sglang(cls: type) -> None:
    structs = sgl.request_structs()
    assert cls.__name__ in structs, f"SGLang {P.SGLANG_VERSION} has no request struct {cls.__name__}"
    theirs = structs[cls.__name__]
    ours = {f.name: f for f in dataclasses.fields(cls)}
    assert set(ours) <= set(theirs), f"{cls.__name__}: not in SGLang: {set(ours) - set(theirs)}"
    their_required = {n for n, f in theirs.items() if f.required}
    assert _required(cls) == their_required, cls.__name__
    for name, f in ours.items():  # our defaults are SGLang's (where it writes them as literals)
        their = theirs[name]
        if not their.inherited and their.default is not sgl.NotLiteral and not their.required:
            assert f.default == their.default, f"{cls.__name__}.{name}: {f.default!r} != SGLang's {their.default!r}"


def test_every_route_exists_and_takes_our_body() -> None:
    theirs = sgl.http_routes()
    missing = {attr: route for attr, route in Route.all().items() if route not in theirs}
    assert not missing, f"routes SGLang {P.SGLANG_VERSION} does not serve: {missing}"
    for route, cls in P.ROUTE_BODIES.items():
        assert theirs[route] == cls.__name__, f"{route} takes {theirs[route]} in SGLang, {cls.__name__} here"


def test_cpu_server_serves_only_protocol_routes() -> None:
    from rlhpc.engine_server.cpu.app import build_app

    # routes only: of the engine, only its mode is read (a deterministic one batches no requests together)
    app = build_app(engine=SimpleNamespace(deterministic=False), address={})
    served = {r.path for r in app.routes}
    assert served == set(Route.all().values()) | set(OpenAIRoute.all().values())


# ------------------------------------------------------------------ sampling params, outputs


def test_sampling_params_exist_in_sglang_with_their_no_effect_defaults() -> None:
    theirs = sgl.sampling_params()
    assert P.SAMPLING_PARAMS <= set(theirs), P.SAMPLING_PARAMS - set(theirs)
    for name, values in P.NO_EFFECT_VALUES.items():
        default = theirs[name].default
        if default is not None and default is not sgl.NotLiteral:
            assert default in values, f"{name}: SGLang's default {default!r} is not among {values}"


def test_cpu_engine_classifies_every_sampling_param() -> None:
    known = cpu_requests.USED | cpu_requests.HARMLESS | set(P.NO_EFFECT_VALUES)
    assert known == P.SAMPLING_PARAMS
    assert not cpu_requests.USED & cpu_requests.HARMLESS


def test_meta_info_keys_exist_in_sglang() -> None:
    assert P.MetaInfo.all() <= sgl.meta_info_keys(), P.MetaInfo.all() - sgl.meta_info_keys()


def test_per_token_weight_version_spans_are_sglangs() -> None:
    assert P.WEIGHT_VERSION_SPAN_KEYS == sgl.weight_version_span_keys()


# ------------------------------------------------------------------ launch flags


def test_launch_flags_exist_in_server_args() -> None:
    flags = sgl.server_flags()
    assert {"--tp-size", "--tensor-parallel-size", "--model-path"} <= flags and "--no-such-flag" not in flags
    assert sgl.has_module(sglang_server.SERVER_MODULE)
    every_option = SGLangSpec(
        tp_size=4, mem_fraction_static=0.5, memory_saver=True, seed=1, nnodes=2, node_rank=1, deterministic=True
    )
    cmd = sglang_server.launch_server_command("/py", "/m", "h", 1, 2, every_option, "h:3")
    emitted = {a for a in cmd if a.startswith("--")}
    assert emitted, cmd
    assert emitted <= flags, f"flags SGLang {P.SGLANG_VERSION} does not know: {emitted - flags}"
    # the engine key: --config FILE.yaml holding api-key (a server flag), not --api-key on the command line
    keyed = sglang_server.launch_server_command("/py", "/m", "h", 1, 2, every_option, "h:3", Path("/k.yaml"))
    assert {"--config", "--api-key"} <= flags and "--config" in keyed


# ------------------------------------------------------------------ flattened weight buckets


def test_flattened_bucket_announce_is_what_sglang_receives() -> None:
    """The body DistributedWeightSender announces (one per bucket) names SGLang's fields, and its
    load_format is the value SGLang's receiver branches on to take ONE broadcast of the bucket."""
    req = P.UpdateWeightsFromDistributedReqInput(
        names=["a", "b"],
        dtypes=["float32", "bfloat16"],
        shapes=[[2, 3], [5]],
        group_name="g",
        flush_cache=False,
        weight_version=None,
        load_format=P.FLATTENED_BUCKET,
    )
    sent = P.body(req)
    assert set(sent) <= set(sgl.request_structs()["UpdateWeightsFromDistributedReqInput"])
    assert sent["load_format"] == "flattened_bucket"
    assert P.FLATTENED_BUCKET in sgl.load_formats_compared(sgl.WEIGHT_UPDATER, "receive_weights_from_distributed")
    theirs = sgl.flattened_bucket_receive()
    assert theirs.broadcasts == 1 and theirs.allocates_with == "empty"
    assert theirs.empty_params == ("names", "dtypes", "shapes", "device")
    assert theirs.flat_dtype == "torch.uint8"


def test_our_flat_layout_follows_sglangs_rules() -> None:
    """Back to back, no padding, every tensor aligned to its element size (SGLang refuses otherwise)."""
    import torch

    from rlhpc.weights.tensor_transport import TensorPayloadError, flat_layout, flat_order

    theirs = sgl.flattened_bucket_receive()
    assert theirs.back_to_back and theirs.checks_alignment
    assert flat_layout([torch.float32, torch.bfloat16, torch.int8], [[2, 3], [5], [3]]) == [(0, 24), (24, 34), (34, 37)]
    with pytest.raises(TensorPayloadError, match="not aligned"):
        flat_layout([torch.int8, torch.float32], [[3], [1]])
    tensors = [torch.zeros(3, dtype=torch.int8), torch.zeros(1), torch.zeros(3, dtype=torch.bfloat16)]
    order = flat_order(tensors)
    assert order == [1, 2, 0]  # widest first: always aligned
    flat_layout([tensors[i].dtype for i in order], [list(tensors[i].shape) for i in order])


def test_colocated_flattened_bucket_is_what_sglang_unpickles() -> None:
    """TensorWeightSender's payload: a dict of SGLang's keys, metadata with its
    FlattenedTensorMetadata fields, and only globals its SafeUnpickler allows (no SGLang class
    pickled by name: the trainer does not import SGLang)."""
    import base64
    import io
    import pickle

    import torch

    from rlhpc.weights.tensor_transport import SharedStaging, deserialize_flat_bucket, serialize_flat_bucket

    assert P.FLATTENED_BUCKET in sgl.load_formats_compared(sgl.WEIGHT_UPDATER, "update_weights_from_tensor")
    theirs = sgl.flattened_bucket_from_tensor()
    tensors = [torch.arange(6.0).reshape(2, 3), torch.tensor([7, 8], dtype=torch.int16)]
    staging = SharedStaging()
    (payload,) = serialize_flat_bucket(staging.pack(tensors), ["a", "b"], tensors)

    named: list[tuple[str, str]] = []

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str):  # noqa: ANN202
            named.append((module, name))
            return super().find_class(module, name)

    obj = Recording(io.BytesIO(base64.b64decode(payload))).load()
    assert set(obj) == theirs.payload_keys == {"flattened_tensor", "metadata"}
    assert set(named) <= sgl.safe_unpickler_globals(), set(named) - sgl.safe_unpickler_globals()
    for meta in obj["metadata"]:
        assert all(hasattr(meta, f) for f in theirs.metadata_fields), theirs.metadata_fields
    # SGLang cuts each tensor out as flat[start:end].view(dtype).reshape(shape): so does the CPU engine
    assert theirs.flat_view == "self.flattened_tensor[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)"
    got = deserialize_flat_bucket(payload).tensors()
    assert [n for n, _ in got] == ["a", "b"] and all(torch.equal(x, y) for (_, x), y in zip(got, tensors))
    staging.close()


@pytest.mark.parametrize("function", ["update_weights_from_distributed", "update_weights_from_tensor"])
def test_a_weight_update_answer_confirms_the_version_as_sglangs_does(function: str) -> None:
    """The sender reads the version from the last bucket's answer instead of asking again."""
    notes = sgl.weight_version_notes(function)
    assert len(notes) == 1, notes
    before, expr, after = notes[0]
    assert expr == "obj.weight_version"
    assert P.weight_version_note("17") == f"{before}17{after}"


# ------------------------------------------------------------------ weight-update sessions


def test_weight_update_session_refusals_are_sglangs() -> None:
    """SGLang refuses an update outside begin/end, a second begin and an end without a begin with
    these messages; the CPU engine answers the same and the sender recognises the second one."""
    for route in (Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED, Route.UPDATE_WEIGHTS_FROM_TENSOR):
        assert sgl.refusal_messages(route.lstrip("/")) == {P.outside_session_message(route)}
    assert sgl.refusal_messages("begin_weight_update") == {P.SESSION_ALREADY_OPEN}
    assert sgl.refusal_messages("end_weight_update") == {P.NO_SESSION_OPEN}


# ------------------------------------------------------------------ OpenAI-compatible routes (issue 29)


def test_a_request_supplied_chat_template_is_refused_in_sglangs_words() -> None:
    assert OP.REQUEST_TEMPLATE_REFUSED in sgl.chat_request_refusals()


def test_openai_routes_are_sglangs() -> None:
    theirs = sgl.http_routes()
    ours = {*OpenAIRoute.all().values(), *OP.HarnessRoute.all().values()}  # the agent endpoint serves all
    assert ours <= set(theirs), ours - set(theirs)


@pytest.mark.parametrize(
    ("cls", "models"),
    [
        (OP.CompletionRequest, sgl.openai_models),
        (OP.ChatCompletionRequest, sgl.openai_models),
        (OP.ResponsesRequest, sgl.openai_models),
        (AM.AnthropicMessagesRequest, sgl.anthropic_models),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_openai_request_fields_are_sglangs_with_its_defaults(cls: type, models) -> None:
    theirs = models()[cls.__name__]
    ours = cls.model_fields
    assert set(ours) <= set(theirs), f"{cls.__name__}: not in SGLang {P.SGLANG_VERSION}: {set(ours) - set(theirs)}"
    for name, f in ours.items():
        assert f.is_required() == theirs[name].required, f"{cls.__name__}.{name}: required differs"
        their = theirs[name].default
        if not theirs[name].required and their is not sgl.NotLiteral:
            assert f.default == their, f"{cls.__name__}.{name}: {f.default!r} != SGLang's {their!r}"


def test_fields_the_agent_endpoint_takes_without_reading_are_sglangs() -> None:
    responses, messages = sgl.openai_models()["ResponsesRequest"], sgl.anthropic_models()["AnthropicMessagesRequest"]
    assert {*OP.RESPONSES_ANY, *OP.RESPONSES_NO_EFFECT} <= set(responses)
    assert {*AM.ANY, *AM.NO_EFFECT} <= set(messages)
    for name, values in OP.RESPONSES_NO_EFFECT.items():  # SGLang's default changes nothing
        if responses[name].default is not sgl.NotLiteral:
            assert responses[name].default in values, name


def test_anthropic_stop_reasons_and_error_types_are_sglangs() -> None:
    assert sgl.module_constant(sgl.ANTHROPIC_SERVING, "STOP_REASON_MAP") == AM.STOP_REASONS
    errors = sgl.module_constant(sgl.ANTHROPIC_SERVING, "ERROR_TYPE_MAP")
    assert {k: v for k, v in errors.items() if k in AM.ERROR_TYPES} == AM.ERROR_TYPES


def test_sglang_decodes_with_special_tokens_when_tools_are_offered() -> None:
    """Issue 42 item 4: why the CPU engine, the agent endpoint and episodes read tool calls from a
    text that keeps special tokens (``rlhpc.wire.tool_calls.markup_text``), and drop the stop token."""
    chat = [line.strip() for line in sgl.source(sgl.OPENAI_SERVING_CHAT).splitlines() if line.strip()]
    at = chat.index('if effective_tools and request.tool_choice != "none":')
    assert chat[at + 1] == "request.skip_special_tokens = False"
    trim = sgl.source(sgl.DETOKENIZER).split("def trim_matched_stop", 1)[1].split("\n    def ", 1)[0]
    assert "return output[:-1]" in trim  # the stop token that ended an output is not in its text


def test_openai_fields_accepted_at_no_effect_values_are_sglangs() -> None:
    models = sgl.openai_models()
    theirs = set(models["CompletionRequest"]) | set(models["ChatCompletionRequest"])
    assert set(OP.NO_EFFECT) <= theirs, set(OP.NO_EFFECT) - theirs
    for name, values in OP.NO_EFFECT.items():  # SGLang's default is among the values that change nothing
        for model in ("CompletionRequest", "ChatCompletionRequest"):
            field = models[model].get(name)
            if field is not None and field.default is not sgl.NotLiteral:
                assert field.default in values, f"{model}.{name}: SGLang's default {field.default!r} not in {values}"


@pytest.mark.parametrize(
    ("ours", "their_models"),
    [
        (OP.MODEL_CARD_FIELDS, ["ModelCard"]),
        (OP.COMPLETION_RESPONSE_FIELDS, ["CompletionResponse"]),
        (OP.COMPLETION_CHOICE_FIELDS, ["CompletionResponseChoice"]),
        (OP.CHAT_RESPONSE_FIELDS, ["ChatCompletionResponse"]),
        (OP.CHAT_CHOICE_FIELDS, ["ChatCompletionResponseChoice"]),
        (OP.CHAT_MESSAGE_FIELDS, ["ChatMessage"]),
        (OP.TOOL_CALL_FIELDS, ["ToolCall"]),
        (OP.FUNCTION_FIELDS, ["FunctionResponse"]),
        (OP.COMPLETION_LOGPROBS_FIELDS, ["LogProbs"]),
        (OP.CHAT_TOKEN_LOGPROB_FIELDS, ["ChatCompletionTokenLogprob"]),
        (OP.USAGE_FIELDS, ["UsageInfo"]),
        (OP.DELTA_FIELDS, ["DeltaMessage"]),
        (OP.STREAM_CHOICE_FIELDS, ["CompletionResponseStreamChoice", "ChatCompletionResponseStreamChoice"]),
    ],
    ids=lambda x: x[0] if isinstance(x, list) else "",
)
def test_openai_response_fields_are_sglangs(ours: frozenset[str], their_models: list[str]) -> None:
    models = sgl.openai_models()
    theirs = set().union(*(models[m] for m in their_models))
    assert ours <= theirs, f"not in SGLang's {their_models}: {ours - theirs}"


# ------------------------------------------------------------------ weight updates beside requests in flight


def test_weight_calls_wait_for_requests_in_flight_unless_paused() -> None:
    """The CPU engine's ModelUpdateLock (app.py) is SGLang's: every request holds the
    model-update lock shared, and a session call or update of an engine that is not paused takes
    it alone; abort_all_requests aborts before waiting. rlhpc's push therefore pauses first."""
    session = sgl.function_code(sgl.TOKENIZER_CONTROL, "_weight_update_session_call")
    assert "if is_paused:" in session and "async with self.model_update_lock.writer_lock:" in session
    update = sgl.function_code(sgl.TOKENIZER_CONTROL, "update_weights_from_tensor")
    assert update.index("self.abort_request(abort_all=True)") < update.index("self.model_update_lock.writer_lock")
    generate = sgl.function_code(sgl.TOKENIZER_MANAGER, "generate_request")
    assert generate.index("wait_for(lambda: not self.is_pause)") < generate.index("self.model_update_lock.reader_lock")
    pause = sgl.function_code(sgl.TOKENIZER_MANAGER, "pause_generation")
    assert "self.abort_request(abort_all=True)" in pause and "await self.model_update_lock.is_locked()" in pause


def test_a_busy_cache_flush_fails_the_update_as_the_cpu_engine_s() -> None:
    """The last bucket's flush fails the update (weights in, version not recorded) unless the
    scheduler is idle, ignoring its queue only while paused in place or retracting; /flush_cache
    answers 400 then: the CPU engine's Engine.flushable and P.FLUSH_BUSY / P.FLUSH_FAILED."""
    assert P.FLUSH_BUSY in sgl.string_constants(sgl.SCHEDULER_WEIGHT_UPDATER, "flush_cache_after_weight_update")
    flush = sgl.function_code(sgl.SCHEDULER, "flush_cache")
    assert "if self.is_fully_idle(ignore_waiting=self._engine_paused):" in flush
    route = sgl.function_code(sgl.HTTP_SERVER, "flush_cache")
    assert P.FLUSH_FAILED in sgl.string_constants(sgl.HTTP_SERVER, "flush_cache")
    assert "status_code=200 if ret.success else HTTPStatus.BAD_REQUEST" in route
    # the version is recorded on the tokenizer side only when the update succeeded
    update = sgl.function_code(sgl.TOKENIZER_CONTROL, "update_weights_from_tensor")
    assert "if success and obj.weight_version is not None:" in update
    assert "/update_weight_version" in sgl.http_routes()


def test_each_tp_rank_reads_its_own_payload() -> None:
    """serialized_named_tensors holds one payload per TP rank; each rank unpickles only its own
    (another rank's copy would unbalance CUDA IPC's reference count): TensorWeightSender sends
    each engine as many separate pickles as it has ranks (serialize_flat_bucket(ranks=tp))."""
    own = sgl.function_code(sgl.TP_WORKER, "deserialize_own_rank")
    assert "serialized_named_tensors[get_parallel().tp_rank]" in own
    assert sgl.request_structs()["UpdateWeightsFromTensorReqInput"]["serialized_named_tensors"].required
    patch = sgl.source("sglang/srt/utils/patch_torch.py")
    assert "_REDUCE_TENSOR_ARG_DEVICE_INDEX = 6" in patch and "get_device_properties(device).uuid" in patch


# ------------------------------------------------------------------ LoRA adapters (issue 45)

LORA_FIELDS = "sglang/srt/arg_groups/fields/lora.py"
LORA_HOOK = "sglang/srt/arg_groups/lora_hook.py"
LORA_MANAGER = "sglang/srt/lora/lora_manager.py"
LORA_REGISTRY = "sglang/srt/lora/lora_registry.py"
LORA_UTILS = "sglang/srt/lora/utils.py"
LORA_MEM_POOL = "sglang/srt/lora/mem_pool.py"


def _texts(path: str, function: str) -> set[str]:
    """The strings ``function`` builds: its literals, and each f-string with ``{}`` for what it formats."""
    out = set()
    for n in ast.walk(ast.parse(sgl.function_code(path, function))):
        if isinstance(n, ast.JoinedStr):
            out.add("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in n.values))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def test_lora_routes_answer_sglangs_lora_update_output() -> None:
    """The three adapter routes (and their bodies, checked above with every route) answer
    LoRAUpdateOutput, 200 on success and 400 otherwise; a tensor push is recorded as "__tensor__"."""
    theirs = sgl.request_structs()["LoRAUpdateOutput"]
    ours = {f.name: f for f in dataclasses.fields(P.LoRAUpdateOutput)}
    assert set(ours) <= set(theirs) and _required(P.LoRAUpdateOutput) == {n for n, f in theirs.items() if f.required}
    for route in (Route.LOAD_LORA_ADAPTER, Route.LOAD_LORA_ADAPTER_FROM_TENSORS, Route.UNLOAD_LORA_ADAPTER):
        code = sgl.function_code(sgl.HTTP_SERVER, route.lstrip("/"))
        assert "HTTPStatus.OK if result.success else HTTPStatus.BAD_REQUEST" in code, route
    to_ref = next(
        f
        for f in sgl._classes(sgl.IO_STRUCT)["LoadLoRAAdapterFromTensorsReqInput"].body
        if getattr(f, "name", "") == "to_ref"
    )
    assert f"lora_path='{L.TENSOR_LORA_PATH}'" in ast.unparse(to_ref)
    assert "lora_path" in sgl.request_structs()["GenerateReqInput"]  # a request names its adapter so


def test_lora_launch_flags_are_sglangs_and_both_engines_take_them() -> None:
    from rlhpc.engine_server.cpu.command import server_command
    from rlhpc.engine_server.cpu.server import parse_args

    serving = L.LoraServing(16, ("q_proj", "v_proj"), max_loras_per_batch=4, paths=("a=/x",))
    flags = sgl.server_flags()
    assert {f for f in serving.flags() if f.startswith("--")} <= flags
    assert sgl.module_constant("sglang/srt/utils/common.py", "SUPPORTED_LORA_TARGET_MODULES") == list(
        L.SUPPORTED_TARGET_MODULES
    )
    assert sgl.module_constant("sglang/srt/utils/common.py", "LORA_TARGET_ALL_MODULES") == L.ALL
    default = next(
        s.value.value
        for s in sgl._classes(LORA_FIELDS)["Lora"].body
        if isinstance(s, ast.AnnAssign) and getattr(s.target, "id", "") == "max_loras_per_batch"
    )
    assert default == L.DEFAULT_MAX_LORAS_PER_BATCH
    spec = SGLangSpec(tp_size=1, mem_fraction_static=0.5, memory_saver=False, seed=1, lora=serving)
    sglang_cmd = sglang_server.launch_server_command("/py", "/m", "h", 1, 2, spec)
    cpu_cmd = server_command("/py", "/m", "127.0.0.1", "/r", "1", "1", lora=serving)
    assert serving.flags() == sglang_cmd[-len(serving.flags()) :] == cpu_cmd[-len(serving.flags()) :]
    assert parse_args(["--model-path", "/m", *serving.flags()]).lora == serving  # the CPU engine reads them back
    # --enable-lora without --lora-paths needs the rank and the targets, in SGLang's words
    assert L.NEEDS_RANK_AND_TARGETS in _texts(LORA_HOOK, "check_lora_server_args")
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "/m", L.ENABLE_LORA, L.MAX_LORA_RANK, "8"])


def test_max_loaded_loras_is_sglangs() -> None:
    """--max-loaded-loras (a shared fleet's engines hold many adapters): SGLang's flag (default
    no limit), its launch checks in its words, and its rule past the limit: the load succeeds and
    the least recently used adapter (loaded, or named by a request) is unloaded."""
    from rlhpc.engine_server.cpu.server import parse_args

    assert L.MAX_LOADED_LORAS in sgl.server_flags()
    default = next(
        s.value
        for s in sgl._classes(LORA_FIELDS)["Lora"].body
        if isinstance(s, ast.AnnAssign) and getattr(s.target, "id", "") == "max_loaded_loras"
    )
    assert isinstance(default, ast.Constant) and default.value is None
    launch = _texts(LORA_HOOK, "check_lora_server_args")
    assert L.loaded_below_batch("{}", "{}") in launch and L.more_paths_than_loaded("{}", "{}") in launch
    with pytest.raises(RlhpcError, match="max_loaded_loras should be greater than or equal"):
        L.LoraServing(8, ("all",), max_loras_per_batch=4, max_loaded_loras=3)
    with pytest.raises(RlhpcError, match="should not exceed max_loaded_loras"):
        L.LoraServing(8, ("all",), max_loras_per_batch=1, paths=("a=/x", "b=/y"), max_loaded_loras=1)
    serving = L.LoraServing(8, ("all",), max_loras_per_batch=2, max_loaded_loras=3)
    assert parse_args(["--model-path", "/m", *serving.flags()]).lora == serving
    load = sgl.function_code("sglang/srt/managers/tokenizer_control_mixin.py", "load_lora_adapter")
    assert "while self.lora_registry.num_registered_loras > get_lora().max_loaded_loras:" in load
    assert "await self.lora_registry.lru_lora_name(exclude_pinned=True)" in load
    assert L.evicting("{}", "{}", "{}") in _texts("sglang/srt/managers/tokenizer_control_mixin.py", "load_lora_adapter")
    # the LRU order: the registry is ordered by use, a request's lookup moves its adapter to the end
    assert "self._registry.move_to_end(name)" in sgl.function_code(LORA_REGISTRY, "get_unregistered_loras")
    assert "return next(iter(self._registry), None)" in sgl.function_code(LORA_REGISTRY, "lru_lora_name")


def test_lora_fit_rules_are_sglangs() -> None:
    """An adapter fits when its rank is within --max-lora-rank and its targets, as the fused
    modules serving them, within --lora-target-modules ("all" on either side fits)."""
    can_support = sgl.function_code(LORA_MEM_POOL, "can_support")
    for line in (
        "if config.r > self.max_lora_rank:",
        "target_module_names = get_normalized_target_modules(config.target_modules)",
        "if 'all' in target_module_names:",
        "return target_module_names.issubset(self.target_modules)",
    ):
        assert line in can_support, line
    fn = next(
        n
        for n in ast.walk(ast.parse(sgl.function_code(LORA_UTILS, "get_normalized_target_modules")))
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "params_mapping"
    )
    theirs = {k: v for k, v in ast.literal_eval(fn.value).items() if k != v}
    assert theirs == {k: v for k, v in L._FUSED.items() if k != v}
    assert L.NOT_ALL_STRING in _texts(LORA_UTILS, "get_normalized_target_modules")
    serving = L.LoraServing(8, ("q_proj", "down_proj"))
    assert L.fits(8, ["k_proj"], serving) and L.fits(4, "all-linear", serving)
    assert not L.fits(9, ["q_proj"], serving) and not L.fits(4, ["gate_proj"], serving)


def test_lora_refusals_are_in_sglangs_words() -> None:
    cases = [
        (LORA_MANAGER, "validate_new_adapter", L.already_loaded("{}")),
        (LORA_MANAGER, "validate_new_adapter", L.does_not_fit("{}", "{}")),  # type: ignore[arg-type]
        (LORA_REGISTRY, "unregister", L.does_not_exist("{}", []).replace("dict_keys([])", "{}")),
        (sgl.TOKENIZER_MANAGER, "_validate_and_resolve_lora", L.requested_not_enabled("{}")),
        (sgl.TOKENIZER_MANAGER, "_resolve_lora_path", L.never_loaded("{}", []).replace("dict_keys([])", "{}")),
        (sgl.TOKENIZER_MANAGER, "_resolve_lora_path", L.reload_failed("{}", "{}")),
        (sgl.TOKENIZER_CONTROL, "load_lora_adapter", L.NOT_ENABLED),
        (sgl.TOKENIZER_CONTROL, "load_lora_adapter_from_tensors", L.NOT_ENABLED),
        (sgl.TOKENIZER_CONTROL, "unload_lora_adapter", L.NOT_ENABLED),
        (sgl.IO_STRUCT, "_normalize_lora_paths", "lora_path should be a list or a string."),
    ]
    for path, function, ours in cases:
        assert ours in _texts(path, function), (function, ours)
    # an unloaded adapter is loaded again from its path when a request names it (the CPU engine too)
    resolve = sgl.function_code(sgl.TOKENIZER_MANAGER, "_resolve_lora_path")
    assert "new_lora_ref = self.lora_ref_cache[lora_path]" in resolve and "LoadLoRAAdapterReqInput(" in resolve
    assert "scaling: float = self.config.lora_alpha / self.config.r" in sgl.source("sglang/srt/lora/lora.py")


def test_openai_requests_name_their_adapter_as_sglangs() -> None:
    parse = sgl.function_code("sglang/srt/entrypoints/openai/serving_base.py", "_parse_model_parameter")
    assert "if model.startswith(f'{served_model_name}:'):" in parse and "model.split(':', 1)" in parse
    resolve = sgl.function_code("sglang/srt/entrypoints/openai/serving_base.py", "_resolve_lora_path")
    assert "if adapter_from_model is not None:" in resolve  # the model's adapter wins over lora_path
    assert L.openai_adapter("s3://m:a", "s3://m", None) == "a" and L.openai_adapter("m", "m", "b") == "b"
    assert L.openai_adapter("x:a", "m", "b") == "a" and L.openai_adapter("m:", "m", "b") == "b"
    listing = sgl.function_code(sgl.HTTP_SERVER, "available_models")
    assert "id=lora_ref.lora_name" in listing and "root=lora_ref.lora_path" in listing and "parent=" in listing
