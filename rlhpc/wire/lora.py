"""LoRA serving as SGLang 0.5.23 does it, written once: the launch flags both engines take, the
words SGLang refuses with, and its rules for an adapter's rank and target modules.

The routes and request bodies are in ``rlhpc.wire.protocol``; the SGLang launcher
(``rlhpc.engine_server.sglang``) and the CPU engine's command line
(``rlhpc.engine_server.cpu.command``) both take their LoRA flags from ``LoraServing.flags``.
tests/unit/test_sglang_protocol.py checks each flag, message and rule against the wheel's sources.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rlhpc.errors import RlhpcError

# SGLang's launch flags (sglang/srt/arg_groups/fields/lora.py)
ENABLE_LORA = "--enable-lora"
MAX_LORA_RANK = "--max-lora-rank"
LORA_TARGET_MODULES = "--lora-target-modules"
MAX_LORAS_PER_BATCH = "--max-loras-per-batch"
MAX_LOADED_LORAS = "--max-loaded-loras"  # adapters held at once; a load past it unloads the least recently used
LORA_PATHS = "--lora-paths"
DEFAULT_MAX_LORAS_PER_BATCH = 8  # SGLang's, counting the base model as one

ALL = "all"  # --lora-target-modules all: every module SGLang supports in the model
ALL_LINEAR = "all-linear"  # PEFT's shorthand in an adapter's config: SGLang reads it as "all"
# --lora-target-modules' choices (sglang/srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES)
SUPPORTED_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj",
    "wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
    "embed_tokens", "lm_head", "qkvr", "wo_ud",
)  # fmt: skip
# The fused module an adapter's target serves (SGLang's get_normalized_target_modules): a server
# started with q_proj holds room for qkv_proj, so an adapter of k_proj fits it too
_FUSED = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
    "vocab_emb": "embed_tokens", "embeddings": "embed_tokens", "word_embeddings": "embed_tokens",
    "output": "lm_head", "unembed_tokens": "lm_head",
    "q_a_proj": "fused_qkv_a_proj_with_mqa", "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
    "wq_b": "indexer.wq_b", "wk": "indexer.wk", "weights_proj": "indexer.weights_proj",
}  # fmt: skip

# The name the trained engines serve a run's adapter under (actor.lora.push: adapter): every push
# loads it again under this name, and every request of the policy names it
POLICY_ADAPTER = "policy"

# What an adapter pushed from tensors is recorded as loaded from (SGLang's LoRARef.lora_path)
TENSOR_LORA_PATH = "__tensor__"


@dataclass(frozen=True)
class LoraServing:
    """An engine serving LoRA adapters: the room it keeps (largest rank, modules adapted) and how
    many adapters (the base model counts as one) a batch may mix. ``paths``: adapters loaded at
    start, ``NAME=PATH`` or ``PATH`` (named by their path), as SGLang's --lora-paths.
    ``max_loaded_loras``: adapters held at once (None: no limit); a load past it unloads the
    least recently used adapter, as SGLang does."""

    max_lora_rank: int
    target_modules: tuple[str, ...]
    max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH
    paths: tuple[str, ...] = ()
    max_loaded_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_lora_rank < 1:
            raise RlhpcError(f"max_lora_rank {self.max_lora_rank}", "give the largest adapter rank served (>= 1)")
        bad = [m for m in self.target_modules if m not in (*SUPPORTED_TARGET_MODULES, ALL)]
        if not self.target_modules or bad:
            raise RlhpcError(
                f"LoRA target modules {list(self.target_modules)}: {bad or 'none given'}",
                f"name modules SGLang adapts ({', '.join(SUPPORTED_TARGET_MODULES)}), or '{ALL}'",
            )
        if ALL in self.target_modules and len(self.target_modules) > 1:
            raise RlhpcError(
                f"LoRA target modules {list(self.target_modules)}: '{ALL}' with others",
                f"give '{ALL}' alone (SGLang refuses it beside other modules)",
            )
        if self.max_loras_per_batch < 1:
            raise RlhpcError(f"max_loras_per_batch {self.max_loras_per_batch}", "give at least 1 (SGLang's default: 8)")
        if self.max_loaded_loras is not None:
            if self.max_loaded_loras < self.max_loras_per_batch:
                raise RlhpcError(
                    loaded_below_batch(self.max_loaded_loras, self.max_loras_per_batch),
                    f"give {MAX_LOADED_LORAS} at least {MAX_LORAS_PER_BATCH} ({self.max_loras_per_batch})",
                )
            if len(self.paths) > self.max_loaded_loras:
                raise RlhpcError(
                    more_paths_than_loaded(self.max_loaded_loras, len(self.paths)),
                    f"load at most {self.max_loaded_loras} adapters at start, or raise {MAX_LOADED_LORAS}",
                )

    @classmethod
    def for_adapter(cls, rank: int, target_modules: str | Iterable[str]) -> LoraServing:
        """Room for one adapter of ``rank`` on ``target_modules`` (peft's: "all-linear" or names)."""
        targets = (ALL,) if isinstance(target_modules, str) else tuple(target_modules)
        return cls(max_lora_rank=rank, target_modules=targets)

    @classmethod
    def for_run(cls, lora: Any) -> LoraServing | None:
        """What a run's trained engines serve: room for its adapter when ``actor.lora`` pushes
        adapters (``push: adapter``), else None (full weights pushed, nothing served by name)."""
        return cls.for_adapter(lora.rank, lora.target_modules) if lora is not None and lora.push == "adapter" else None

    def flags(self) -> list[str]:
        """SGLang's launch flags for this (the CPU engine takes the same ones)."""
        out = [ENABLE_LORA, MAX_LORA_RANK, str(self.max_lora_rank), LORA_TARGET_MODULES, *self.target_modules]
        out += [MAX_LORAS_PER_BATCH, str(self.max_loras_per_batch)]
        if self.max_loaded_loras is not None:
            out += [MAX_LOADED_LORAS, str(self.max_loaded_loras)]
        if self.paths:
            out += [LORA_PATHS, *self.paths]
        return out


def normalized_targets(target_modules: str | Iterable[str]) -> set[str]:
    """SGLang's ``get_normalized_target_modules``: each target by its last name component, as the
    fused module that serves it; PEFT's string shorthand ("all-linear", "all") as {"all"}."""
    if isinstance(target_modules, str):
        if target_modules not in (ALL, ALL_LINEAR):
            raise ValueError(NOT_ALL_STRING)
        return {ALL}
    return {_FUSED.get(name.split(".")[-1], name.split(".")[-1]) for name in target_modules}


def fits(rank: int, adapter_targets: str | Iterable[str], serving: LoraServing) -> bool:
    """SGLang's ``LoRAMemoryPool.can_support``: rank within --max-lora-rank, and targets within
    --lora-target-modules ("all" on either side fits)."""
    if rank > serving.max_lora_rank:
        return False
    theirs = normalized_targets(adapter_targets)
    return ALL in theirs or ALL in serving.target_modules or theirs <= normalized_targets(serving.target_modules)


def openai_adapter(model: str | None, served_model_name: str, lora_path: Any) -> Any:
    """The adapter an OpenAI-compatible request names, as SGLang's serving_base resolves it: an
    adapter in ``model`` ("BASE:ADAPTER"; the served name itself may hold colons) wins over the
    request's ``lora_path``."""
    if model and ":" in model and model != served_model_name:
        if model.startswith(f"{served_model_name}:"):
            adapter = model[len(served_model_name) + 1 :]
        else:
            adapter = model.split(":", 1)[1]
        if adapter.strip():
            return adapter.strip()
    return lora_path


# ------------------------------------------------------------------ SGLang's words

NOT_ALL_STRING = "Only 'all' or 'all-linear' can be used as the string for target module"
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
# launched with --enable-lora, without --lora-paths to infer the room from
NEEDS_RANK_AND_TARGETS = (
    "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
    "--lora-target-modules for LoRA initialization."
)


def requested_not_enabled(name: str) -> str:
    """A /generate naming an adapter on an engine without --enable-lora."""
    return (
        f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server with "
        "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
    )


def _keys(names: Iterable[str]) -> str:
    return f"dict_keys({list(names)!r})"  # SGLang prints the registry's dict keys


def never_loaded(name: str, known: Iterable[str]) -> str:
    """A /generate naming an adapter never loaded under that name."""
    return f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {_keys(known)}."


def reload_failed(name: str, why: str) -> str:
    """A /generate naming an adapter unloaded since: SGLang loads it again from its path, which an
    adapter pushed from tensors does not have."""
    return f"Failed to implicitly load LoRA adapter {name}: {why}"


def already_loaded(name: str) -> str:
    return f"Failed to load LoRA adapter {name} because it is already loaded"


def does_not_fit(name: str, rank: int) -> str:
    """An adapter of a larger rank than --max-lora-rank, or of modules outside --lora-target-modules."""
    return (
        f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool configuration. "
        "Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` and that the "
        "target modules are included in `--lora-target-modules`."
    )


def loaded_below_batch(max_loaded: int, per_batch: int) -> str:
    """--max-loaded-loras below --max-loras-per-batch (SGLang's launch check)."""
    return (
        "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
        f"max_loaded_loras={max_loaded}, max_loras_per_batch={per_batch}"
    )


def more_paths_than_loaded(max_loaded: int, paths: int) -> str:
    """More --lora-paths than --max-loaded-loras (SGLang's launch check)."""
    return (
        "The number of LoRA paths should not exceed max_loaded_loras. "
        f"max_loaded_loras={max_loaded}, lora_paths={paths}"
    )


def evicting(name: str, loaded: int, max_loaded: int) -> str:
    """What SGLang logs as a load past --max-loaded-loras unloads the least recently used adapter."""
    return (
        f"Unloading least recently used LoRA adapter '{name}' "
        f"(current number of adapters: {loaded}, max allowed: {max_loaded})"
    )


def does_not_exist(name: str, loaded: Iterable[str]) -> str:
    """An unload of a name not loaded."""
    return f"{not_loaded(name)}. Loaded LoRAs: {_keys(loaded)}"


def not_loaded(name: str) -> str:
    """What an engine's refusal to unload ``name`` says: it holds no adapter of that name."""
    return f"LoRA with name {name} does not exist"
