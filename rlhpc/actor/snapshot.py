"""A rank's state copied to host memory, written as safetensors files at the speed of plain I/O.

A snapshot is the only part of a save the train loop waits for (``RankBase.snapshot``); the
rank's checkpoint thread then writes it (``RankBase.write_snapshot``). Each file's tensors are
copied into one flat host buffer laid out as the file's data section, so writing the file is
one header and one buffer, and its CRC-32 (for the checkpoint manifest) is computed from
memory while the file is fsynced, instead of reading the file back. The buffers are kept
between saves and refilled in place: at most one save is in flight (the driver waits for a
commit before the next snapshot), so a buffer is never refilled while it is being written. On
CUDA they are pinned, so the device-to-host copies run at full bandwidth.

The files are plain safetensors (any safetensors reader, transformers included, reads them).
Tensors are laid out by element size, largest first, so every tensor's data is aligned for its
dtype and ``read_safetensors`` can hand out views of one read buffer.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from pathlib import Path

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
BY_NAME = {v: k for k, v in DTYPES.items()}
WRITE_CHUNK = 64 << 20  # os.write moves at most ~2 GiB per call; smaller chunks keep memory flat


class FlatTensors:
    """One safetensors file's worth of tensors in a reusable flat host buffer."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._layout: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None
        self._buffer: torch.Tensor | None = None
        self._header = b""

    def fill(self, named: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        """Copy ``named`` into the buffer (allocated again only when names, shapes or dtypes change)."""
        order = sorted(named, key=lambda n: -named[n].element_size())  # stable: same-size keep their order
        layout = [(n, named[n].dtype, tuple(named[n].shape)) for n in order]
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name, dtype, shape in layout:
            n = dtype.itemsize * int(torch.Size(shape).numel())
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)  # the data section starts 8-aligned
        self._header = struct.pack("<Q", len(text)) + text
        if layout != self._layout:
            self._buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=self.pin)
            self._layout = layout
        offset = 0
        for name, _, _ in layout:
            t = named[name].detach()
            n = t.numel() * t.element_size()
            self._buffer[offset : offset + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=self.pin)
            offset += n

    def write(self, path: Path) -> tuple[int, int]:
        """Write the file and fsync it; its size and CRC-32 (summed from memory during the fsync)."""
        data = memoryview(self._buffer.numpy())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, memoryview(self._header))
            _write_all(fd, data)
            crc: list[int] = []
            summer = threading.Thread(target=lambda: crc.append(zlib.crc32(data, zlib.crc32(self._header))))
            summer.start()  # zlib releases the GIL: the checksum runs while the disk flushes
            try:
                os.fsync(fd)
            finally:
                summer.join()
        finally:
            os.close(fd)
        return len(self._header) + len(data), crc[0]


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view[:WRITE_CHUNK]) :]


def _read_header(f) -> dict:
    (n,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(n))


def read_exactly(f, path: Path, into: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor ``into`` from the file's current position."""
    view = memoryview(into.view(-1).view(torch.uint8).numpy())
    while view:
        got = f.readinto(view)
        if not got:
            raise OSError(f"{path} is shorter than its header says")
        view = view[got:]


def safetensors_header(path: Path) -> tuple[dict[str, dict], dict[str, str]]:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets) and metadata,
    read from its header only."""
    with open(path, "rb") as f:
        header = _read_header(f)
    return header, header.pop("__metadata__", None) or {}


def fits(entries: dict[str, dict], tensors: dict[str, torch.Tensor]) -> bool:
    """The file's tensors have exactly these names, dtypes and shapes."""
    return entries.keys() == tensors.keys() and all(
        BY_NAME[e["dtype"]] == tensors[n].dtype and e["shape"] == list(tensors[n].shape) for n, e in entries.items()
    )


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors (views of one buffer, read in one pass) and its metadata."""
    with open(path, "rb", buffering=0) as f:
        header = _read_header(f)
        buffer = torch.empty(os.fstat(f.fileno()).st_size - f.tell(), dtype=torch.uint8)
        read_exactly(f, path, buffer)
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        dtype = BY_NAME[info["dtype"]]
        raw = buffer[start:end]
        if start % dtype.itemsize:  # not aligned (a file laid out by another writer): copy it out
            raw = raw.clone()
        tensors[name] = raw.view(dtype).view(info["shape"])
    return tensors, metadata


def read_safetensors_into(path: Path, targets: dict[str, torch.Tensor]) -> None:
    """Read each tensor of a safetensors file into ``targets[name]``, in file order, straight into
    the target's memory where it is a contiguous CPU tensor of the file's dtype: no read buffer
    to allocate (and fault in) and no copy. Elsewhere (CUDA, another dtype) through a buffer
    and ``copy_``. Every name in the file must be in ``targets``, with the file's shape."""
    with open(path, "rb", buffering=0) as f:
        header = _read_header(f)
        header.pop("__metadata__", None)
        data_start = f.tell()
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            target, dtype = targets[name], BY_NAME[info["dtype"]]
            if list(target.shape) != info["shape"]:
                raise ValueError(f"{path}: {name} has shape {info['shape']}, the model's is {list(target.shape)}")
            start, end = info["data_offsets"]
            f.seek(data_start + start)
            target = target.detach()
            if target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous():
                read_exactly(f, path, target)
            else:
                staged = torch.empty(end - start, dtype=torch.uint8)
                read_exactly(f, path, staged)
                target.copy_(staged.view(dtype).view(info["shape"]))


def fsync_files(paths: list[Path]) -> None:
    """Flush each file to stable storage."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
