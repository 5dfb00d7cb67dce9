"""The CPU engine's LoRA adapters, held by name as SGLang holds them, and applied per row.

An adapter is PEFT's: for each adapted ``nn.Linear`` of the base model, ``lora_A`` [r, in] and
``lora_B`` [out, r], and ``lora_alpha / r`` as its scaling. A batch's rows each name their adapter
(or none); while it runs, a forward hook on every adapted module adds each row's
``lora_B(lora_A(x)) * scaling`` to the base output, as PEFT's ``LoraLayer.forward`` computes it
(its dropout is the identity at inference), so a row generates as ``transformers`` + ``peft`` with
that adapter would, whatever its batch-mates use. The base weights are never touched: a weight
push and an adapter push stay independent.

The checks and their words are SGLang's (``rlhpc.wire.lora``); what SGLang would serve wrongly
(rsLoRA's scaling, per-module ranks, DoRA, biases) or the CPU engine cannot (embedding
adapters, added tokens) is refused with the reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from rlhpc.wire import lora as L
from rlhpc.wire.protocol import EngineError

log = logging.getLogger("rlhpc.cpu_server")

# PEFT's names: base_model.model.<module>.lora_A.weight (get_peft_model_state_dict drops the
# adapter's own name; a state_dict() of the PeftModel keeps it: <module>.lora_A.<adapter>.weight)
_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True, eq=False)  # by identity: a batch groups its rows by the adapter object
class Adapter:
    name: str
    path: str  # the directory it was loaded from (L.TENSOR_LORA_PATH: pushed)
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (lora_A, lora_B)


def _module_and_part(name: str) -> tuple[str, str]:
    """A PEFT tensor name -> (the adapted module's name in the base model, "lora_A" | "lora_B")."""
    parts = name.removeprefix(_PREFIX).split(".")
    if parts[-1] != "weight":
        raise EngineError(f"adapter tensor {name!r} is no lora_A/lora_B weight (biases are not served)")
    for k in range(len(parts) - 2, 0, -1):
        if parts[k] in ("lora_A", "lora_B"):
            return ".".join(parts[:k]), parts[k]
    raise EngineError(f"adapter tensor {name!r} is no lora_A/lora_B weight of a module (PEFT's names)")


class Adapters:
    """The adapters an engine holds (``serving``: None without --enable-lora), and the hooks that
    apply them to a batch."""

    def __init__(self, model: torch.nn.Module, serving: L.LoraServing | None):
        self.model = model
        self.serving = serving
        self.loaded: dict[str, Adapter] = {}  # least recently used first (loaded or named by a request)
        self.paths: dict[str, str] = {}  # every adapter ever loaded, name -> path (SGLang's lora_ref_cache)
        self._lock = threading.Lock()  # loads (control thread) against lookups (event loop)
        self._linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        for entry in serving.paths if serving is not None else ():
            name, _, path = entry.partition("=") if "=" in entry else (entry, "", entry)
            self.load_path(name, path)

    @property
    def enabled(self) -> bool:
        return self.serving is not None

    def listing(self) -> dict[str, str]:
        """The adapters loaded, name -> path (an answer's ``loaded_adapters``)."""
        return {a.name: a.path for a in self.loaded.values()}

    # -------------------------------------------------------------- loading

    def load_path(self, name: str, path: str) -> dict[str, str]:
        """An adapter from a PEFT directory (/load_lora_adapter, --lora-paths)."""
        self.require_enabled()
        d = Path(path)
        weights = next((d / w for w in ADAPTER_WEIGHTS if (d / w).is_file()), None)
        if not (d / ADAPTER_CONFIG).is_file() or weights is None:
            raise EngineError(f"{path} is not a PEFT adapter directory ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS[0]})")
        config = json.loads((d / ADAPTER_CONFIG).read_text())
        if weights.suffix == ".bin":
            tensors = torch.load(weights, map_location="cpu", weights_only=True)
        else:
            tensors = load_file(weights)
        return self.load(name, config, tensors, str(path))

    def load(self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], path: str) -> dict[str, str]:
        """Check and hold an adapter; refused whole, before anything is held."""
        self.require_enabled()
        assert self.serving is not None
        rank, targets = self._config(name, config)
        if name in self.loaded:
            raise EngineError(L.already_loaded(name))
        if not L.fits(rank, targets, self.serving):
            raise EngineError(L.does_not_fit(name, rank))
        scaling = float(config["lora_alpha"]) / rank
        weights = self._weights(name, rank, tensors)
        with self._lock:
            self.loaded[name] = Adapter(name, path, rank, scaling, weights)
            self.paths[name] = path
            evicted = self._evict()
        log.info("LoRA adapter %s loaded (rank %d, %d modules, from %s)", name, rank, len(weights), path)
        for old, count in evicted:
            log.info("%s", L.evicting(old, count, self.serving.max_loaded_loras))
        return self.listing()

    def _evict(self) -> list[tuple[str, int]]:
        """Past --max-loaded-loras, the least recently used adapters leave (SGLang's LRU; a
        request naming one later loads it again from its path). Under the lock."""
        limit, evicted = self.serving.max_loaded_loras, []
        while limit is not None and len(self.loaded) > limit:
            evicted.append((next(iter(self.loaded)), len(self.loaded)))
            del self.loaded[evicted[-1][0]]
        return evicted

    def unload(self, name: str) -> dict[str, str]:
        self.require_enabled()
        with self._lock:
            if name not in self.loaded:
                raise EngineError(L.does_not_exist(name, self.loaded))
            del self.loaded[name]  # rows already given it keep it until their batch ends (SGLang waits for them)
        log.info("LoRA adapter %s unloaded", name)
        return self.listing()

    def require_enabled(self) -> None:
        if self.serving is None:
            raise EngineError(L.NOT_ENABLED)

    @staticmethod
    def _config(name: str, config: dict[str, Any]) -> tuple[int, Any]:
        """(rank, target modules) of a PEFT LoraConfig's dict; what cannot be served as PEFT
        computes it is refused."""
        if not isinstance(config, dict) or not {"r", "lora_alpha", "target_modules"} <= set(config):
            raise EngineError(f"adapter {name}: its config needs r, lora_alpha and target_modules (PEFT's)")
        rank = config["r"]
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise EngineError(f"adapter {name}: rank r={rank!r} must be a positive integer")
        if config.get("use_dora"):  # SGLang's words
            raise EngineError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
        unserved = {
            "use_rslora": "rsLoRA scales by alpha/sqrt(r); SGLang serves alpha/r",
            "rank_pattern": "per-module ranks; SGLang serves one rank per adapter",
            "alpha_pattern": "per-module alphas; SGLang serves one alpha per adapter",
            "lora_bias": "LoRA biases are not served",
        }
        for key, why in unserved.items():
            if config.get(key):
                raise EngineError(f"adapter {name}: {key}={config[key]!r} cannot be served ({why}); train without it")
        targets = config["target_modules"]
        try:
            L.normalized_targets(targets)
        except ValueError as e:
            raise EngineError(str(e)) from e
        return rank, targets

    def _weights(
        self, name: str, rank: int, tensors: dict[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for tensor_name, t in tensors.items():
            module, part = _module_and_part(tensor_name)
            if module not in self._linears:
                raise EngineError(
                    f"adapter {name}: {tensor_name} adapts {module!r}, which is no linear module of the model "
                    "(the CPU engine serves adapters of linear modules, not of embeddings)"
                )
            parts.setdefault(module, {})[part] = t
        if not parts:
            raise EngineError(f"adapter {name} has no tensors")
        weights = {}
        for module, ab in sorted(parts.items()):
            if set(ab) != {"lora_A", "lora_B"}:
                raise EngineError(f"adapter {name}: {module} has {sorted(ab)} alone (needs lora_A and lora_B)")
            linear = self._linears[module]
            a, b = ab["lora_A"], ab["lora_B"]
            want_a, want_b = (rank, linear.in_features), (linear.out_features, rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise EngineError(
                    f"adapter {name}: {module} lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; "
                    f"rank {rank} on this model needs {want_a} and {want_b}"
                )
            if not (a.dtype.is_floating_point and b.dtype.is_floating_point):
                raise EngineError(f"adapter {name}: {module} tensors of dtype {a.dtype}/{b.dtype}")
            device, dtype = linear.weight.device, linear.weight.dtype
            # copies: a pushed tensor may live in the sender's shared memory
            weights[module] = (a.to(device, dtype, copy=True), b.to(device, dtype, copy=True))
        return weights

    # -------------------------------------------------------------- requests

    def resolve(self, names: list[str | None]) -> list[Adapter | None]:
        """Each row's adapter, as SGLang resolves a request's ``lora_path``: one unloaded since is
        loaded again from its path (an adapter pushed from tensors has none)."""
        if not any(names):
            return [None] * len(names)
        if self.serving is None:
            raise EngineError(L.requested_not_enabled(next(n for n in names if n)))
        for name in dict.fromkeys(n for n in names if n):
            if name in self.loaded:
                continue
            if name not in self.paths:
                raise EngineError(L.never_loaded(name, self.paths))
            path = self.paths[name]
            if path == L.TENSOR_LORA_PATH:
                raise EngineError(
                    L.reload_failed(name, "it was loaded from tensors, not from a path; push it again to use it")
                )
            try:
                self.load_path(name, path)
            except EngineError as e:
                if name not in self.loaded:  # a concurrent load of the same name is fine (SGLang's words)
                    raise EngineError(L.reload_failed(name, str(e))) from e
        with self._lock:
            for name in dict.fromkeys(n for n in names if n):  # recently used: last to be evicted
                self.loaded[name] = self.loaded.pop(name)
            return [self.loaded[n] if n else None for n in names]

    @contextlib.contextmanager
    def applied(self, rows: list[Adapter | None]) -> Iterator[None]:
        """While a batch of these rows runs (its forwards, any recompute), each row's adapter is
        added to the modules it adapts."""
        groups: dict[str, list[tuple[Adapter, torch.Tensor | None]]] = {}
        for adapter in dict.fromkeys(a for a in rows if a is not None):
            idx = [i for i, a in enumerate(rows) if a is adapter]
            index = None if len(idx) == len(rows) else torch.tensor(idx, device=self._device())
            for module in adapter.weights:
                groups.setdefault(module, []).append((adapter, index))
        handles = [self._linears[m].register_forward_hook(_hook(m, g)) for m, g in groups.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device


def _hook(module: str, groups: list[tuple[Adapter, torch.Tensor | None]]) -> Any:
    def add_delta(_mod: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        x = inputs[0]
        for adapter, index in groups:
            a, b = adapter.weights[module]
            if index is None:  # every row: PEFT's computation on the same tensors
                out = out + F.linear(F.linear(x, a), b) * adapter.scaling
            else:
                out = out.index_add(0, index, F.linear(F.linear(x[index], a), b) * adapter.scaling)
        return out

    return add_delta
