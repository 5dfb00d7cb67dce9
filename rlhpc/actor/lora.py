"""LoRA on the torch actor (``actor.lora``): ``peft``'s adapters on the HF model, in PEFT's format.

``peft.get_peft_model`` wraps the model's target layers in place: each keeps its frozen weight
as ``<layer>.base_layer.weight`` beside its adapter's ``lora_A`` / ``lora_B``; only the adapters
train. What the rest of the actor needs of that model is here: the merged weights under the base
model's names (what a full weight push sends), the adapter alone as PEFT saves it (its
``adapter_config.json`` and its tensors under PEFT's names), the reference model as the same
model with its adapters off, and the merge of a saved adapter into a plain HF directory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlhpc.actor.checkpoint_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rlhpc.config import LoraConfig
from rlhpc.errors import RlhpcError

# peft is imported where it is used: it takes seconds, which a run without LoRA should not pay.
ADAPTER = "default"  # peft's name of a model's one adapter


def wrap(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """``model`` with LoRA adapters on ``lora.target_modules`` (a ``peft.PeftModel``; the model
    is changed in place: its forward runs with them); every other parameter frozen."""
    import peft

    try:
        return peft.get_peft_model(model, peft.LoraConfig(**lora.peft_kwargs()))
    except ValueError as e:  # peft's own refusal: a target module the model does not have
        raise RlhpcError(
            f"actor.lora cannot wrap the model: {e}",
            "name the model's linear layers in actor.lora.target_modules, or write all-linear",
        ) from e


def _layers(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """peft's LoRA layers of ``module`` by name (each has a ``base_layer`` and ``lora_A``)."""
    return {name: m for name, m in module.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}


def merged_named(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The full weights of ``module`` (the wrapped HF model) under the base model's names: each
    adapted weight as base + scale * B @ A (peft's ``get_delta_weight``, the sum its merge
    computes), the others as they are. Fresh tensors for the adapted ones, views otherwise."""
    layers = _layers(module)
    for name, p in module.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if not owner:
            yield name, p.detach()
            continue
        if leaf == "weight":
            with torch.no_grad():
                yield f"{owner}.weight", p.detach() + layers[owner].get_delta_weight(ADAPTER)
        else:
            yield f"{owner}.{leaf}", p.detach()


def base_named(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The frozen base weights (the reference model) under the base model's names."""
    for name, p in module.named_parameters():
        if ".lora_" not in name:
            yield name.replace(".base_layer.", "."), p.detach()


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (``base_model.model....lora_A.weight``),
    sharing the parameters' storage: a read into them is a read into the adapter."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=ADAPTER)


def adapter_config(model: Any) -> dict[str, Any]:
    """The adapter's config as ``adapter_config.json`` holds it (peft's ``to_dict``, JSON-ready;
    sets as sorted lists, so two saves of one adapter write the same bytes)."""
    d = model.peft_config[ADAPTER].to_dict()
    d = {k: sorted(v) if isinstance(v, set) else v for k, v in d.items()}
    return json.loads(json.dumps(d))


def write_adapter_config(config: dict[str, Any], directory: Path) -> Path:
    """``adapter_config.json`` as peft writes it (sorted keys, indent 2)."""
    path = directory / ADAPTER_CONFIG
    path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return path


def write_adapter(model: Any, directory: Path) -> Path:
    """The adapter as ``save_pretrained`` leaves it (``adapter_config.json`` and
    ``adapter_model.safetensors``) in ``directory``, written whole before it is named there (a
    reader never sees half a file)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.detach().contiguous().cpu() for n, t in adapter_tensors(model).items()}
    part = directory / f".{ADAPTER_WEIGHTS}.part"
    save_file(tensors, str(part), metadata={"format": "pt"})
    part.replace(directory / ADAPTER_WEIGHTS)
    write_adapter_config(adapter_config(model), directory)
    return directory


def is_adapter_dir(directory: Path) -> bool:
    return (directory / ADAPTER_CONFIG).is_file() and (directory / ADAPTER_WEIGHTS).is_file()


def merge_to_hf(adapter_dir: Path, base: Path, out: Path) -> None:
    """Write ``base`` with the adapter of ``adapter_dir`` merged in (peft's ``merge_and_unload``,
    in the base's dtype) as a plain HF model directory at ``out``: config, safetensors,
    generation config and the tokenizer (the checkpoint's, or else the base's)."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not is_adapter_dir(adapter_dir):
        raise RlhpcError(
            f"{adapter_dir} holds no LoRA adapter ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})",
            "pass a checkpoint of a run with actor.lora, or its actor/ directory",
        )
    if not (base / "config.json").is_file():
        raise RlhpcError(
            f"the base model {base} has no config.json",
            "pass the run's model directory with --base (RUN_DIR/base_model for a tiny model)",
        )
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype="auto")
    merged = peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out))
    tokenizer_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))


class AdaptersOff:
    """The reference model of a LoRA actor: the wrapped model's forward with its adapters off
    (the base model as loaded: no second copy). Called as the model is."""

    def __init__(self, model: Any):
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)
