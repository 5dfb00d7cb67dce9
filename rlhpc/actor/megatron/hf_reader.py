"""An HF model directory's tensors by name, read lazily: a rank reads only the slices it holds.

safetensors files (one ``model.safetensors``, or the shards a ``model.safetensors.index.json``
names) are memory-mapped and sliced before anything is copied, so reading rows ``[a, b)`` of a
matrix, or columns, costs those bytes only, in the checkpoint's dtype. A model without
safetensors (``pytorch_model.bin``) is loaded whole, once per rank, as transformers loads it.
``bytes_read`` counts what the reads returned: a rank's share of the checkpoint.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

Index = tuple[slice | int, ...]


class HFReader:
    """``read(name, index)``: tensor ``name`` of the model at ``path``, or its part ``t[index]``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.bytes_read = 0
        self._files: dict[str, Any] = {}  # open safetensors handles, by file name
        self._whole: dict[str, torch.Tensor] | None = None
        if (self.path / INDEX).is_file():
            self._where = dict(json.loads((self.path / INDEX).read_text())["weight_map"])
        elif (self.path / SINGLE).is_file():
            from safetensors import safe_open

            self._files[SINGLE] = safe_open(str(self.path / SINGLE), framework="pt", device="cpu")
            self._where = dict.fromkeys(self._files[SINGLE].keys(), SINGLE)
        else:
            from rlhpc.model import load_model

            log.warning("%s has no safetensors: every megatron rank loads the whole model", self.path)
            self._whole = load_model(self.path).state_dict()
            self._where = dict.fromkeys(self._whole, "")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.path} holds no tensor {name!r}")
        if self._whole is not None:
            t = self._whole[name][index] if index else self._whole[name]
        else:
            handle = self._handle(self._where[name])
            t = handle.get_slice(name)[index] if index else handle.get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _handle(self, file: str) -> Any:
        if file not in self._files:
            from safetensors import safe_open

            self._files[file] = safe_open(str(self.path / file), framework="pt", device="cpu")
        return self._files[file]

    def close(self) -> None:
        self._files.clear()
        self._whole = None
