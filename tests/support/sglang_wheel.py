"""SGLang's own names, read from the sglang wheel's sources without importing (or installing) it.

The Makefile (`make test`, `make test-fast`) downloads the wheel of the version rlhpc supports
into ``$(VENV)/wheels`` (SGLang itself needs CUDA, so it is not installed). The readers below
parse its sources with ``ast``: request structs (``io_struct.py``), sampling params, HTTP routes
and the body type each route takes (``http_server.py``), the OpenAI-compatible request and response
models (``entrypoints/openai/protocol.py``), ``meta_info`` keys
(``tokenizer_manager.py``), the launch flags (``server_args.py`` and the field namespaces it
assembles ``ServerArgs`` from) and how a flattened weight bucket is received (``weight_updater.py``,
``weight_sync/tensor_bucket.py``).
"""

from __future__ import annotations

import ast
import functools
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rlhpc.wire.protocol import SGLANG_VERSION

REPO = Path(__file__).resolve().parents[2]
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING_PARAMS = "sglang/srt/sampling/sampling_params.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"
WEIGHT_VERSIONS = "sglang/srt/utils/weight_versions.py"  # per-token weight-version spans in meta_info
SERVER_ARGS = "sglang/srt/server_args.py"
DOWNLOAD = f"{{python}} -m pip download -q --no-deps --dest {{venv}}/wheels sglang=={SGLANG_VERSION}"


def wheel_path() -> Path:
    """The downloaded wheel; fails the test (never skips) with the command that fetches it."""
    dirs = [Path(sys.prefix) / "wheels", REPO / ".venv" / "wheels"]  # pytest runs from the venv
    for d in dirs:
        found = sorted(d.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if found:
            return found[-1]
    cmd = DOWNLOAD.format(python=Path(sys.executable), venv=Path(sys.prefix))
    pytest.fail(
        f"the sglang {SGLANG_VERSION} wheel is missing (looked in {', '.join(map(str, dirs))}); "
        f"`make test` or `make test-fast` downloads it, or run: {cmd}",
        pytrace=False,
    )


@functools.cache
def source(path: str) -> str:
    with zipfile.ZipFile(wheel_path()) as z:
        return z.read(path).decode()


def has_module(module: str) -> bool:
    """Does the wheel hold ``module`` (dotted name) as a module file?"""
    with zipfile.ZipFile(wheel_path()) as z:
        names = set(z.namelist())
    base = module.replace(".", "/")
    return f"{base}.py" in names or f"{base}/__init__.py" in names


@functools.cache
def _tree(path: str) -> ast.Module:
    return ast.parse(source(path), filename=path)


def _classes(path: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in _tree(path).body if isinstance(n, ast.ClassDef)}


# ------------------------------------------------------------------ request structs


@dataclass(frozen=True)
class Field:
    name: str
    required: bool
    default: Any  # a literal default, or NotLiteral
    inherited: bool


class NotLiteral:
    """A default that is not a plain literal (a call, a name)."""


def _default(value: ast.expr | None) -> Any:
    if value is None:
        return None
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) in (
        "field",
        "Field",
    ):  # dataclasses', pydantic's
        for kw in value.keywords:
            if kw.arg == "default":
                return _default(kw.value)
        return NotLiteral
    try:
        return ast.literal_eval(value)
    except ValueError:
        return NotLiteral


def _required(value: ast.expr | None) -> bool:
    if value is None:
        return True
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) in ("field", "Field"):
        return not value.args and not any(kw.arg in ("default", "default_factory") for kw in value.keywords)
    return False


@functools.cache
def request_structs() -> dict[str, dict[str, Field]]:
    """Class name -> its fields (own and inherited from classes of the same module), in ``io_struct.py``."""
    classes = _classes(IO_STRUCT)

    def fields_of(name: str, inherited: bool) -> dict[str, Field]:
        cls = classes[name]
        out: dict[str, Field] = {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields_of(base.id, True))
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                n = stmt.target.id
                out[n] = Field(n, _required(stmt.value), _default(stmt.value), inherited)
        return out

    return {name: fields_of(name, False) for name in classes}


@functools.cache
def sampling_params() -> dict[str, Field]:
    """SGLang's ``SamplingParams`` fields."""
    cls = _classes(SAMPLING_PARAMS)["SamplingParams"]
    return {
        s.target.id: Field(s.target.id, _required(s.value), _default(s.value), False)
        for s in cls.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    }


# ------------------------------------------------------------------ routes


def _body_type(fn: ast.AsyncFunctionDef | ast.FunctionDef) -> str | None:
    """The request struct a handler's body is parsed into: ``obj: X`` or ``obj: Annotated[X, Body()]``."""
    for arg in fn.args.args:
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "Annotated":
            ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
        if isinstance(ann, ast.Name) and (ann.id.endswith("ReqInput") or ann.id.endswith("Req")):
            return ann.id
    return None


@functools.cache
def http_routes() -> dict[str, str | None]:
    """Route -> the request struct its handler takes (None: no body), from ``@app.<method>("/...")``."""
    routes: dict[str, str | None] = {}
    for node in ast.walk(_tree(HTTP_SERVER)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if (
                isinstance(dec, ast.Call)
                and isinstance(dec.func, ast.Attribute)
                and getattr(dec.func.value, "id", None) == "app"
                and dec.args
                and isinstance(dec.args[0], ast.Constant)
                and isinstance(dec.args[0].value, str)
            ):
                routes[dec.args[0].value] = _body_type(node)
    return routes


@functools.cache
def meta_info_keys() -> frozenset[str]:
    """Keys the tokenizer manager (and its weight-version helper) writes into outputs' ``meta_info``
    (dict literals and ``meta_info[...]``)."""
    keys: set[str] = set()
    for node in (n for path in (TOKENIZER_MANAGER, WEIGHT_VERSIONS) for n in ast.walk(_tree(path))):
        if isinstance(node, ast.Dict):
            keys.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
        elif (
            isinstance(node, ast.Subscript)
            and getattr(node.value, "id", None) == "meta_info"
            and isinstance(node.slice, ast.Constant)
        ):
            keys.add(node.slice.value)
    return frozenset(keys)


def weight_version_span_keys() -> tuple[str, ...]:
    """The keys of one ``meta_info["weight_versions"]`` entry, as ``add_weight_versions_to_meta_info`` writes them."""
    for node in ast.walk(_tree(WEIGHT_VERSIONS)):
        if isinstance(node, ast.FunctionDef) and node.name == "add_weight_versions_to_meta_info":
            for d in ast.walk(node):
                if isinstance(d, ast.Dict) and d.keys:
                    return tuple(k.value for k in d.keys if isinstance(k, ast.Constant))
    raise AssertionError(f"add_weight_versions_to_meta_info not found in {WEIGHT_VERSIONS}")


# ------------------------------------------------------------------ launch flags


def _call_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _field_flags(stmt: ast.AnnAssign) -> list[str]:
    """``name: A[T, "help"]`` -> ``--name``; ``A[T, Arg(cli_name=..., aliases=[...], no_cli=...)]`` honoured
    (as ``arg_utils.add_cli_args_from_dataclass`` does)."""
    ann = stmt.annotation
    if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "A"):
        return []  # not a CLI field
    meta = ann.slice.elts[1] if isinstance(ann.slice, ast.Tuple) and len(ann.slice.elts) > 1 else None
    name = "--" + stmt.target.id.replace("_", "-")
    aliases: list[str] = []
    if isinstance(meta, ast.Call) and _call_name(meta.func) == "Arg":
        kw = {k.arg: k.value for k in meta.keywords}
        if "no_cli" in kw and ast.literal_eval(kw["no_cli"]):
            return []
        if "cli_name" in kw:
            name = ast.literal_eval(kw["cli_name"])
        if "aliases" in kw:
            aliases = list(ast.literal_eval(kw["aliases"]))
    return [name, *aliases]


@functools.cache
def server_flags() -> frozenset[str]:
    """Every ``sglang.launch_server`` flag: the fields of the namespaces ``ServerArgs`` is assembled
    from (``_INPUT_NAMESPACES`` in server_args.py) plus the flags ``add_cli_args`` registers by hand."""
    tree = _tree(SERVER_ARGS)
    where: dict[str, str] = {}  # imported class -> module file
    namespaces: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang.srt.arg_groups.fields"):
            for alias in node.names:
                where[alias.asname or alias.name] = node.module.replace(".", "/") + ".py"
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_INPUT_NAMESPACES" for t in node.targets):
            namespaces = [e.id for e in node.value.elts]
    if not namespaces:
        raise AssertionError(f"no _INPUT_NAMESPACES in {SERVER_ARGS}: SGLang changed how it builds its flags")
    flags: set[str] = set()
    for ns in namespaces:
        cls = _classes(where[ns])[ns]
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                flags.update(_field_flags(stmt))
    for node in ast.walk(tree):  # parser.add_argument("--flag", ...) registered by hand
        if isinstance(node, ast.Call) and _call_name(node.func) == "add_argument":
            flags.update(a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--"))
    return frozenset(flags)


# ------------------------------------------------------------------ flattened-bucket weight updates

WEIGHT_UPDATER = "sglang/srt/model_executor/model_runner_components/weight_updater.py"
TENSOR_BUCKET = "sglang/srt/weight_sync/tensor_bucket.py"


def _functions(path: str) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(_tree(path)) if isinstance(n, ast.FunctionDef)}


def load_formats_compared(path: str, function: str) -> frozenset[str]:
    """String literals that ``function`` compares ``load_format`` with (``load_format == "..."``)."""
    found = set()
    for node in ast.walk(_functions(path)[function]):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "load_format":
            found.update(c.value for c in node.comparators if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return frozenset(found)


@dataclass(frozen=True)
class BucketReceive:
    """How SGLang receives a flattened bucket over a weight-update group."""

    broadcasts: int  # torch.distributed.broadcast calls in the receive function
    allocates_with: str | None  # the FlattenedTensorBucket constructor it calls
    empty_params: tuple[str, ...]  # FlattenedTensorBucket.empty's parameters
    flat_dtype: str | None  # dtype of the one flat tensor empty() allocates
    checks_alignment: bool  # empty() refuses a tensor whose byte offset is not a multiple of its itemsize
    back_to_back: bool  # empty() places each tensor right after the previous one (offset += size)


@functools.cache
def flattened_bucket_receive() -> BucketReceive:
    fn = _functions(WEIGHT_UPDATER)["_receive_bucketed_weights_from_distributed"]
    broadcasts = sum(
        1 for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("distributed.broadcast")
    )
    ctor = next(
        (
            n.func.attr
            for n in ast.walk(fn)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and ast.unparse(n.func.value) == "FlattenedTensorBucket"
        ),
        None,
    )
    empty = _functions(TENSOR_BUCKET)["empty"]
    params = tuple(a.arg for a in empty.args.args if a.arg != "cls")
    flat_dtype = next(
        (
            ast.unparse(kw.value)
            for n in ast.walk(empty)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.empty"
            for kw in n.keywords
            if kw.arg == "dtype"
        ),
        None,
    )
    checks_alignment = any(
        isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) and ast.unparse(n) == "offset % dtype.itemsize"
        for n in ast.walk(empty)
    )
    back_to_back = any(isinstance(n, ast.AugAssign) and ast.unparse(n) == "offset += size" for n in ast.walk(empty))
    return BucketReceive(broadcasts, ctor, params, flat_dtype, checks_alignment, back_to_back)


@dataclass(frozen=True)
class TensorBucketReceive:
    """How SGLang takes a flattened bucket inside ``/update_weights_from_tensor``."""

    payload_keys: frozenset[str]  # the keys it reads from the unpickled payload
    metadata_fields: tuple[str, ...]  # FlattenedTensorMetadata's fields, read as attributes
    flat_view: str  # how it cuts one tensor out of the flat one


@functools.cache
def flattened_bucket_from_tensor() -> TensorBucketReceive:
    fn = _functions(WEIGHT_UPDATER)["_update_weights_from_flattened_bucket"]
    keys = frozenset(
        n.slice.value
        for n in ast.walk(fn)
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)
    )
    meta = _classes(TENSOR_BUCKET)["FlattenedTensorMetadata"]
    fields = tuple(
        st.target.id for st in meta.body if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
    )
    rebuild = _functions(TENSOR_BUCKET)["reconstruct_tensors"]
    view = next(
        ast.unparse(n)
        for n in ast.walk(rebuild)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "reshape"
    )
    return TensorBucketReceive(keys, fields, view)


@functools.cache
def safe_unpickler_globals() -> frozenset[tuple[str, str]]:
    """The (module, name) pairs SGLang's SafeUnpickler lets a tensor payload name."""
    cls = _classes("sglang/srt/utils/common.py")["SafeUnpickler"]
    for st in cls.body:
        if isinstance(st, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "ALLOWED_GLOBALS" for t in st.targets
        ):
            return frozenset(ast.literal_eval(st.value))
    raise AssertionError("SafeUnpickler.ALLOWED_GLOBALS not found")


TOKENIZER_CONTROL = "sglang/srt/managers/tokenizer_control_mixin.py"


def weight_version_notes(function: str) -> list[tuple[str, str, str]]:
    """(text before, formatted expression, text after) of every f-string ``function`` appends to
    ``message`` (``message += f"..."``) in the tokenizer manager's weight-update code."""
    fn = next(
        n
        for n in ast.walk(_tree(TOKENIZER_CONTROL))
        if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef) and n.name == function
    )
    notes = []
    for n in ast.walk(fn):
        if isinstance(n, ast.AugAssign) and ast.unparse(n.target) == "message" and isinstance(n.value, ast.JoinedStr):
            parts = n.value.values
            if len(parts) == 3 and isinstance(parts[1], ast.FormattedValue):
                notes.append((parts[0].value, ast.unparse(parts[1].value), parts[2].value))
    return notes


# ------------------------------------------------------------------ weight-update sessions

SCHEDULER_WEIGHT_UPDATER = "sglang/srt/managers/scheduler_components/weight_updater.py"


def refusal_messages(function: str) -> frozenset[str]:
    """The literal ``message=`` texts of the answers ``function`` (the scheduler's weight-update
    side) builds with ``success=False``: its refusals."""
    found = set()
    for n in ast.walk(_functions(SCHEDULER_WEIGHT_UPDATER)[function]):
        if not isinstance(n, ast.Call):
            continue
        kw = {k.arg: k.value for k in n.keywords}
        success, message = kw.get("success"), kw.get("message")
        if isinstance(success, ast.Constant) and success.value is False and isinstance(message, ast.Constant):
            found.add(message.value)
    return frozenset(found)


TOKENIZER_CONTROL = "sglang/srt/managers/tokenizer_control_mixin.py"
SCHEDULER = "sglang/srt/managers/scheduler.py"
TP_WORKER = "sglang/srt/managers/tp_worker.py"


def function_code(path: str, function: str) -> str:
    """The source of ``function`` (sync or async, any class) in ``path``, unparsed: comments and
    line breaks gone, adjacent string literals joined."""
    tree = _tree(path)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == function)
    return ast.unparse(fn)


def string_constants(path: str, function: str) -> frozenset[str]:
    """The string literals in ``function`` (adjacent ones joined, as Python joins them)."""
    tree = ast.parse(function_code(path, function))
    return frozenset(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))


# ------------------------------------------------------------------ OpenAI-compatible protocol

OPENAI_PROTOCOL = "sglang/srt/entrypoints/openai/protocol.py"
SERVING_CHAT = "sglang/srt/entrypoints/openai/serving_chat.py"


def chat_request_refusals() -> frozenset[str]:
    """The literal texts ``OpenAIServingChat._validate_request`` returns: why it refuses a chat request."""
    fn = next(
        n for n in ast.walk(_tree(SERVING_CHAT)) if isinstance(n, ast.FunctionDef) and n.name == "_validate_request"
    )
    return frozenset(
        n.value.value
        for n in ast.walk(fn)
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
    )


@functools.cache
def openai_models() -> dict[str, dict[str, Field]]:
    """Pydantic model name -> its fields (own and inherited from models of the same module), in
    ``entrypoints/openai/protocol.py``; private attributes (``_name``) are no fields."""
    return _pydantic_models(OPENAI_PROTOCOL)


ANTHROPIC_PROTOCOL = "sglang/srt/entrypoints/anthropic/protocol.py"
ANTHROPIC_SERVING = "sglang/srt/entrypoints/anthropic/serving.py"
OPENAI_SERVING_CHAT = "sglang/srt/entrypoints/openai/serving_chat.py"
DETOKENIZER = "sglang/srt/managers/detokenizer_manager.py"


@functools.cache
def anthropic_models() -> dict[str, dict[str, Field]]:
    """The same for ``entrypoints/anthropic/protocol.py`` (SGLang's Anthropic Messages API)."""
    return _pydantic_models(ANTHROPIC_PROTOCOL)


def module_constant(path: str, name: str) -> Any:
    """A module-level literal assignment of ``path`` (e.g. a dict of strings)."""
    for node in _tree(path).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(f"{path} assigns no {name}")


def _pydantic_models(path: str) -> dict[str, dict[str, Field]]:
    classes = _classes(path)

    def fields_of(name: str, inherited: bool) -> dict[str, Field]:
        out: dict[str, Field] = {}
        for base in classes[name].bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields_of(base.id, True))
        for stmt in classes[name].body:
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and not stmt.target.id.startswith("_")
            ):
                n = stmt.target.id
                out[n] = Field(n, _required(stmt.value), _default(stmt.value), inherited)
        return out

    return {name: fields_of(name, False) for name in classes}


# ------------------------------------------------------------------ MoE expert weight names

QWEN3_MOE = "sglang/srt/models/qwen3_moe.py"
FUSED_MOE = "sglang/srt/layers/moe/fused_moe_triton/layer.py"


def _method(path: str, cls: str, name: str) -> ast.FunctionDef:
    return next(n for n in _classes(path)[cls].body if isinstance(n, ast.FunctionDef) and n.name == name)


def qwen3_moe_expert_mapping(num_experts: int) -> list[tuple[str, str, int, str]]:
    """``(param_name, weight_name, expert_id, shard_id)`` as ``Qwen3MoeForCausalLM.load_weights``
    builds them: the keyword arguments of its ``FusedMoE.make_expert_params_mapping`` call, and
    that classmethod's return expression evaluated on them (a pure list comprehension)."""
    load = _method(QWEN3_MOE, "Qwen3MoeForCausalLM", "load_weights")
    call = next(
        n
        for n in ast.walk(load)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "FusedMoE.make_expert_params_mapping"
    )
    kwargs: dict[str, Any] = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "num_experts"}
    make = _method(FUSED_MOE, "FusedMoE", "make_expert_params_mapping")
    ret = next(n for n in make.body if isinstance(n, ast.Return))
    code = compile(ast.Expression(ret.value), FUSED_MOE, "eval")
    return eval(code, {**kwargs, "num_experts": num_experts})  # noqa: S307 - SGLang's own literal comprehension


def qwen3_moe_skips_stacked_experts() -> bool:
    """Does ``load_weights`` keep expert names out of its stacked (q/k/v, gate/up) mapping
    (``if "mlp.experts" in name: continue``), so they reach the expert mapping unrenamed?"""
    load = _method(QWEN3_MOE, "Qwen3MoeForCausalLM", "load_weights")
    return any(
        isinstance(n, ast.If) and ast.unparse(n.test) == "'mlp.experts' in name" and isinstance(n.body[0], ast.Continue)
        for n in ast.walk(load)
    )


# ------------------------------------------------------------------ strict behaviours (issue 40)
# What SGLang does where it is strict, read from its sources: the CPU engine does the same, and
# tests/unit/test_sglang_strict.py compares both, so a new pin shows what changed.

ENVIRON = "sglang/srt/environ.py"
COMMON = "sglang/srt/utils/common.py"
CONSTANTS = "sglang/srt/constants.py"
SAMPLER = "sglang/srt/layers/sampler.py"
SAMPLING_BATCH_INFO = "sglang/srt/sampling/sampling_batch_info.py"
MODEL_RUNNER = "sglang/srt/model_executor/model_runner.py"
SCHEDULER = "sglang/srt/managers/scheduler.py"
BOOTSTRAP = "sglang/srt/distributed/bootstrap.py"
OVERRIDES = "sglang/srt/arg_groups/overrides.py"
ATTENTION_HOOK = "sglang/srt/arg_groups/attention_hook.py"
CHOICES = "sglang/srt/arg_groups/choices.py"


def _function(path: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The first function (or method) called ``name`` in ``path``."""
    for n in ast.walk(_tree(path)):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name:
            return n
    raise AssertionError(f"{name} not found in {path}")


def _calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def env_field(name: str) -> tuple[str, Any]:
    """``(kind, default)`` of an ``Envs`` field in environ.py: ``X = EnvBool(True)`` -> ("EnvBool", True)."""
    for stmt in _classes(ENVIRON)["Envs"].body:
        if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == name for t in stmt.targets):
            call = stmt.value
            return _call_name(call.func), ast.literal_eval(call.args[0])
    raise AssertionError(f"{name} is no Envs field in {ENVIRON}")


def env_bool_values() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The strings ``EnvBool.parse`` reads as true, and as false."""
    parse = next(s for s in _classes(ENVIRON)["EnvBool"].body if isinstance(s, ast.FunctionDef) and s.name == "parse")
    found: dict[bool, tuple[str, ...]] = {}
    for n in ast.walk(parse):
        if isinstance(n, ast.If) and isinstance(n.test, ast.Compare) and isinstance(n.body[0], ast.Return):
            found[ast.literal_eval(n.body[0].value)] = tuple(ast.literal_eval(n.test.comparators[0]))
    return found[True], found[False]


def bool_env_var_rule() -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """``get_bool_env_var``'s default, and the strings it reads as true and as false."""
    fn = _function(COMMON, "get_bool_env_var")
    default = ast.literal_eval(fn.args.defaults[-1])
    values = {
        t.id: ast.literal_eval(s.value)
        for s in ast.walk(fn)
        if isinstance(s, ast.Assign)
        for t in s.targets
        if isinstance(t, ast.Name) and t.id in ("truthy_values", "falsy_values")
    }
    return default, values["truthy_values"], values["falsy_values"]


def module_constant_call(path: str, name: str) -> str:
    """The expression a module-level constant is assigned (``X = get_bool_env_var("X")``), unparsed."""
    for stmt in _tree(path).body:
        if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == name for t in stmt.targets):
            return ast.unparse(stmt.value)
    raise AssertionError(f"no module-level {name} in {path}")


@dataclass(frozen=True)
class HealthCheck:
    """SGLang's /health handler."""

    paths: frozenset[str]  # the routes it serves
    switch: str  # the Envs field that, off, makes /health answer 200 without generating
    sampling_params: dict  # of the generation it runs
    input_ids: list[int]
    poll_s: float  # how often it looks for progress
    timeout: str  # the constant it waits for progress up to
    answers: frozenset[int]  # the status codes it answers


@functools.cache
def health_check() -> HealthCheck:
    fn = _function(HTTP_SERVER, "health_generate")
    paths = frozenset(ast.literal_eval(d.args[0]) for d in fn.decorator_list if isinstance(d, ast.Call))
    # the `if not envs.X.get() and request.url.path == "/health": return 200` that skips the generation
    skip = next(
        n for n in ast.walk(fn) if isinstance(n, ast.If) and "request.url.path == '/health'" in ast.unparse(n.test)
    )
    switch = next(
        n.operand.func.value.attr
        for n in ast.walk(skip.test)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not) and ast.unparse(n.operand).startswith("envs.")
    )
    params = next(
        ast.literal_eval(s.value)
        for s in ast.walk(fn)
        if isinstance(s, ast.Assign) and getattr(s.targets[0], "id", None) == "sampling_params"
    )
    gri = next(c for c in _calls(fn) if _call_name(c.func) == "GenerateReqInput")
    input_ids = next(ast.literal_eval(k.value) for k in gri.keywords if k.arg == "input_ids")
    sleep = next(c for c in _calls(fn) if ast.unparse(c.func) == "asyncio.sleep")
    loop = next(n for n in ast.walk(fn) if isinstance(n, ast.While))
    timeout = ast.unparse(loop.test.comparators[0]).split("+")[-1].strip()
    answers = frozenset(
        ast.literal_eval(k.value) for c in _calls(fn) if _call_name(c.func) == "Response" for k in c.keywords
    )
    return HealthCheck(paths, switch, params, input_ids, ast.literal_eval(sleep.args[0]), timeout, answers)


def getenv_default(path: str, constant: str) -> tuple[str, Any]:
    """``(env name, default)`` of a module constant read as ``int(os.getenv("NAME", default))``."""
    call = next(
        c for c in _calls(ast.parse(module_constant_call(path, constant))) if ast.unparse(c.func) == "os.getenv"
    )
    return ast.literal_eval(call.args[0]), ast.literal_eval(call.args[1])


def offload_tag_calls(function: str) -> frozenset[str]:
    """The methods a scheduler memory function calls on its set of released tags (``self.offload_tags``)."""
    fn = _functions(SCHEDULER_WEIGHT_UPDATER)[function]
    return frozenset(
        c.func.attr
        for c in _calls(fn)
        if isinstance(c.func, ast.Attribute) and ast.unparse(c.func.value) == "self.offload_tags"
    )


def reads_released_tags(function: str) -> bool:
    """Does a scheduler memory function look at which tags are released (``tag in self.offload_tags``)?"""
    fn = _functions(SCHEDULER_WEIGHT_UPDATER)[function]
    return any(
        isinstance(n, ast.Compare) and any(ast.unparse(c) == "self.offload_tags" for c in n.comparators)
        for n in ast.walk(fn)
    )


def memory_saver_calls(function: str) -> frozenset[str]:
    """What a scheduler memory function asks of torch_memory_saver (``self.memory_saver_adapter.X``)."""
    fn = _functions(SCHEDULER_WEIGHT_UPDATER)[function]
    return frozenset(
        c.func.attr
        for c in _calls(fn)
        if isinstance(c.func, ast.Attribute) and ast.unparse(c.func.value) == "self.memory_saver_adapter"
    )


def all_memory_tags() -> tuple[str, ...]:
    """``GPU_MEMORY_ALL_TYPES``: what release/resume with no tags covers."""
    consts = {
        t.id: s.value
        for s in _tree(CONSTANTS).body
        if isinstance(s, ast.Assign)
        for t in s.targets
        if isinstance(t, ast.Name)
    }
    return tuple(ast.literal_eval(consts[e.id]) for e in consts["GPU_MEMORY_ALL_TYPES"].elts)


def scheduler_exception_signal() -> str:
    """The signal a scheduler process sends its parent (the HTTP server) when it raises."""
    fn = _function(SCHEDULER, "run_scheduler_process")
    handler = next(h for n in ast.walk(fn) if isinstance(n, ast.Try) for h in n.handlers)
    call = next(c for c in _calls(handler) if _call_name(c.func) == "send_signal")
    return ast.unparse(call.args[0]).removeprefix("signal.")


def sigquit_handler_calls() -> frozenset[str]:
    """What the HTTP server does on that signal (``SignalHandler.running_phase_sigquit_handler``)."""
    fn = _method(TOKENIZER_MANAGER, "SignalHandler", "running_phase_sigquit_handler")
    return frozenset(_call_name(c.func) for c in _calls(fn))


@dataclass(frozen=True)
class SeedRule:
    """How a request's ``sampling_seed`` reaches the sampler."""

    gate: str  # the condition under which seeds are used at all
    gate_source: str  # where that condition comes from
    unseeded: int  # the seed of a request without one, when seeds are used


@functools.cache
def seed_rule() -> SeedRule:
    fn = _function(SAMPLING_BATCH_INFO, "from_schedule_batch")
    assign = next(
        s for s in ast.walk(fn) if isinstance(s, ast.Assign) and getattr(s.targets[0], "id", None) == "sampling_seed"
    )
    ifexp = assign.value
    inner = next(n for n in ast.walk(ifexp.body) if isinstance(n, ast.IfExp))
    source = next(
        ast.unparse(s.value)
        for s in ast.walk(fn)
        if isinstance(s, ast.Assign) and getattr(s.targets[0], "id", None) == ast.unparse(ifexp.test)
    )
    return SeedRule(ast.unparse(ifexp.test), source, ast.literal_eval(inner.orelse))


def greedy_rewrite() -> dict[str, Any]:
    """What ``SamplingParams`` sets when the temperature is below its epsilon (greedy)."""
    for n in ast.walk(_tree(SAMPLING_PARAMS)):
        if isinstance(n, ast.If) and "_SAMPLING_EPS" in ast.unparse(n.test):
            return {
                ast.unparse(s.targets[0]).removeprefix("self."): ast.literal_eval(s.value)
                for s in n.body
                if isinstance(s, ast.Assign)
            }
    raise AssertionError(f"no greedy rewrite in {SAMPLING_PARAMS}")


def sampler_logprob_steps() -> frozenset[str]:
    """The logprob-related expressions of ``Sampler.forward``, unparsed: the tests look for the
    temperature division, the original-logprob switch and the greedy path among them."""
    fn = _method(SAMPLER, "Sampler", "forward")
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Call | ast.BoolOp | ast.BinOp):
            out.add(ast.unparse(n))
    return frozenset(out)


def calls_in(path: str, function: str) -> frozenset[str]:
    """Every call in ``function`` (the first of that name in ``path``), its callee unparsed."""
    return frozenset(ast.unparse(c.func) for c in _calls(_function(path, function)))


@dataclass(frozen=True)
class DeterministicCost:
    """What ``--enable-deterministic-inference`` changes in a server, read from its overrides."""

    sampling_backend: str  # forced
    attention_fallbacks: frozenset[str]  # picked when no --attention-backend is given
    attention_allowed: tuple[str, ...]  # any other --attention-backend is refused
    radix_cache_with: tuple[str, ...]  # backends that keep the radix (prefix) cache; others disable it
    batch_invariant_ops: bool  # batch-invariant kernels replace the usual matmul/softmax ones
    tp_all_reduce: str  # NCCL_ALGO set for TP > 1 (custom all-reduce disabled)


@functools.cache
def deterministic_cost() -> DeterministicCost:
    sampling = next(
        ast.literal_eval(r.value)
        for r in ast.walk(_function(OVERRIDES, "_deterministic_sampling_backend"))
        if isinstance(r, ast.Return) and isinstance(r.value, ast.Dict) and r.value.keys
    )["sampling_backend"]
    attention = _function(OVERRIDES, "_deterministic_attention_backend")
    fallbacks = frozenset(
        ast.literal_eval(s.value)
        for s in ast.walk(attention)
        if isinstance(s, ast.Assign) and getattr(s.targets[0], "id", None) == "backend"
    )
    choices = {
        t.id: ast.literal_eval(s.value)
        for s in _tree(CHOICES).body
        if isinstance(s, ast.Assign)
        for t in s.targets
        if isinstance(t, ast.Name)
        and t.id.endswith("DETERMINISTIC_ATTENTION_BACKEND_CHOICES")
        or isinstance(t, ast.Name)
        and t.id == "RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND"
    }
    invariant = any(
        _call_name(c.func) == "enable_batch_invariant_mode"
        for c in _calls(_function(MODEL_RUNNER, "maybe_enable_batch_invariant_mode"))
    )
    hook = _function(ATTENTION_HOOK, "handle_deterministic_inference")
    nccl = next(
        ast.literal_eval(s.value)
        for s in ast.walk(hook)
        if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "os.environ['NCCL_ALGO']"
    )
    return DeterministicCost(
        sampling,
        fallbacks,
        tuple(choices["DETERMINISTIC_ATTENTION_BACKEND_CHOICES"]),
        tuple(choices["RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND"]),
        invariant,
        nccl,
    )


def tp_memory_check() -> tuple[str, str, float]:
    """``(switch, what it raises, threshold)`` of the check that a TP engine's GPUs have about
    the same free memory: it raises when the least free is below threshold x this GPU's."""
    fn = _function(BOOTSTRAP, "_check_tp_memory_balance")
    switch = next(
        c.func.value.attr
        for c in _calls(fn)
        if isinstance(c.func, ast.Attribute) and c.func.attr == "get" and ast.unparse(c.func).startswith("envs.")
    )
    raised = next(_call_name(n.exc.func) for n in ast.walk(fn) if isinstance(n, ast.Raise))
    threshold = next(
        n.right.value for n in ast.walk(fn) if isinstance(n, ast.BinOp) and isinstance(n.right, ast.Constant)
    )
    return switch, raised, threshold
