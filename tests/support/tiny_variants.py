"""Tiny models with what the tiny configs do not offer: tied embeddings, RoPE scaling (issue 40)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

# Llama-3.2-1B's kind: tied embeddings and Llama 3 RoPE scaling, its original context short (16
# positions) so that the scaling moves most frequencies at a test's positions
TIED_LLAMA3 = {
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
    },
}


def build_variant(base: Path, out: Path, changes: dict, seed: int = 5) -> Path:
    """``base``'s tiny model (``rlhpc.model.build_tiny_model``) with its config changed as
    ``changes`` says and fresh random weights (``seed``); the same tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for f in base.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out
