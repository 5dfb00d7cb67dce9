"""An HF model directory's tensors by name, read lazily: a rank reads only the slices it holds.

safetensors files (one ``model.safetensors``, or the shards a ``model.safetensors.index.json``
names) are memory-mapped and sliced before anything is copied, so reading rows ``[a, b)`` of a
matrix, or columns, costs those bytes only, in the checkpoint's dtype. A model without
safetensors (``pytorch_model.bin``, or the shards of its index) is memory-mapped by
``torch.load(mmap=True)``: a slice touches only its own pages. ``bytes_read`` counts what the
reads returned: a rank's share of the checkpoint.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from rlhpc.errors import RlhpcError

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"

Index = tuple[slice | int, ...]


class HFReader:
    """``read(name, index)``: tensor ``name`` of the model at ``path``, or its part ``t[index]``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.bytes_read = 0
        self._files: dict[str, Any] = {}  # open safetensors handles, by file name
        self._mapped: dict[str, torch.Tensor] | None = None  # a .bin checkpoint's tensors, memory-mapped
        if (self.path / INDEX).is_file():
            self._where = dict(json.loads((self.path / INDEX).read_text())["weight_map"])
        elif (self.path / SINGLE).is_file():
            from safetensors import safe_open

            self._files[SINGLE] = safe_open(str(self.path / SINGLE), framework="pt", device="cpu")
            self._where = dict.fromkeys(self._files[SINGLE].keys(), SINGLE)
        else:
            index = self.path / BIN_INDEX
            files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [BIN]
            if not all((self.path / f).is_file() for f in files):
                raise RlhpcError(
                    f"{self.path} holds no model weights ({SINGLE}, {INDEX}, {BIN} or {BIN_INDEX})",
                    "point model.path at an HF model directory with its weights",
                )
            log.info("%s has no safetensors: reading %s memory-mapped", self.path, ", ".join(files))
            self._mapped = {}
            for f in files:
                self._mapped.update(torch.load(self.path / f, map_location="cpu", mmap=True, weights_only=True))
            self._where = dict.fromkeys(self._mapped, "")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.path} holds no tensor {name!r}")
        if self._mapped is not None:
            t = (self._mapped[name][index] if index else self._mapped[name]).clone()  # off the mapping
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
        self._mapped = None
