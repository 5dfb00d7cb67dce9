"""A process's random number generators: seed them, save and restore their states."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds CUDA


def get_rng_state() -> dict[str, Any]:
    """All RNG states of this process as tensors/ints (loadable with ``weights_only=True``)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy_bit_generator": np_state["bit_generator"],
        "numpy_key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
        "numpy_pos": int(np_state["state"]["pos"]),
        "numpy_has_gauss": int(np_state["has_gauss"]),
        "numpy_gauss": float(np_state["gauss"]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(
        {
            "bit_generator": state["numpy_bit_generator"],
            "state": {"key": state["numpy_key"].numpy().astype(np.uint32), "pos": state["numpy_pos"]},
            "has_gauss": state["numpy_has_gauss"],
            "gauss": state["numpy_gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
