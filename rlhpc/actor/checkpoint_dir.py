"""The layout of an actor checkpoint (``CKPT_DIR/actor/``), shared by both backends and
``tools/convert_checkpoint.py``. Imports nothing heavy, so the tool can use it as it is.

Both backends write ``actor_meta.json`` (world size, optimizer steps, initial model, and the
backend's own keys) and one RNG file per rank; the rest is the backend's: an HF model
directory plus ``optim.safetensors`` (torch; ``optim.pt`` before 2026-12) and, once reset,
the reference model's ``reference.safetensors``, or a torch_dist checkpoint under ``dist/`` (megatron).
With LoRA (torch, ``actor.lora``) the adapter in PEFT's format replaces the model's weights:
``adapter_config.json`` and ``adapter_model.safetensors`` beside the base model's config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ACTOR_SUBDIR = "actor"
META_FILE = "actor_meta.json"
DIST_SUBDIR = "dist"  # megatron: torch_dist checkpoint of model + optimizer
MEGATRON_BACKEND = "megatron"  # meta["backend"] of a megatron checkpoint (absent: torch)
# peft's file names (peft.utils.constants: CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME; a test pins them)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


RNG_PREFIX = "rng_rank"


def rng_file(rank: int) -> str:
    return f"{RNG_PREFIX}{rank}.pt"


def read_meta(actor_dir: Path) -> dict[str, Any]:
    """``actor_meta.json`` of ``actor_dir``; empty when there is none."""
    path = actor_dir / META_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_meta(actor_dir: Path, meta: dict[str, Any]) -> None:
    (actor_dir / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
