"""Named tensors inside an HTTP body, for ``/update_weights_from_tensor`` between colocated processes.

Both directions live here: ``serialize_named_tensors`` (the trainer's side) and the safe
``deserialize_named_tensors`` (the CPU engine's side) that mirrors it.

Colocated tensors cross processes the way SGLang's MultiprocessingSerializer sends them: base64
of a torch ForkingPickler dump of [(name, tensor), ...]. For CUDA tensors that pickles CUDA IPC
handles (so the same sender works against a real SGLang engine on GPU). For CPU tensors torch's
default "file_descriptor" strategy passes fds through a socket that only the pickling process's
multiprocessing children may use (it checks the parent's authkey), so an unrelated server process
cannot open them. The "file_system" strategy instead names a /dev/shm segment that any process of
the same user on the node can map: one copy into shared memory on the sender, none over HTTP, and
torch_shm_manager unlinks the segment once both sides dropped it. Sharing moves a tensor's storage
into shm in place, which must not happen to the trainer's live parameters behind its back, so
CPU tensors go either through ``SharedStaging`` (one copy into a segment kept between pushes) or,
when the trainer put its weights in shared memory itself (``share_memory_by_name``), as they are:
then each engine copies the bytes once and nothing else moves them.

CUDA tensors stay on their GPU (packed into a device buffer, about one bucket of extra memory,
unless they lie flat already): ForkingPickler turns them into IPC handles whatever the sharing
strategy, with an event the receiver waits on before reading, so the packing is complete when
the engine copies. The engine copies and synchronises before it answers (``Engine.load_weights``
in rlhpc.engine_server.cpu), so once every engine has answered the sender may reuse or free the
buffer; torch keeps a block whose receiver still holds a handle in its IPC limbo until
``torch.cuda.ipc_collect``.

Flattened buckets (``load_format="flattened_bucket"``) travel as ONE uint8 tensor per bucket:
each tensor's bytes back to back in ``names`` order, no padding, every tensor starting at a
multiple of its element size (SGLang's receiver checks that). ``flat_layout``, ``flatten_into``
and ``unflatten`` below are both ends of that layout. Over ``/update_weights_from_distributed``
the tensor is broadcast; over ``/update_weights_from_tensor`` (``serialize_flat_bucket``) it is
one handle (shared memory or CUDA IPC) beside each tensor's name, shape, dtype and byte span,
so a push of many tensors opens one mapping per bucket, not one per tensor.
"""

from __future__ import annotations

import base64
import contextlib
import io
import math
import pickle
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as torch_mp


class TensorPayloadError(ValueError):
    """A payload that is not a list of (name, tensor) pairs this process may safely load."""


# ------------------------------------------------------------------ flattened buckets


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def flat_order(tensors: list[torch.Tensor]) -> list[int]:
    """Indices in sending order: wider elements first (stable), so that every tensor starts at a
    multiple of its element size without padding. Uniform dtypes keep their order."""
    return sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())


def flat_layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[tuple[int, int]]:
    """(start, end) byte offsets of each tensor in a flattened bucket; refuses what SGLang refuses."""
    spans = []
    offset = 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        if any(d < 0 for d in shape):
            raise TensorPayloadError(f"negative dimension in shape {list(shape)}")
        width = dtype.itemsize
        if offset % width:
            raise TensorPayloadError(f"a {dtype} tensor at byte offset {offset} is not aligned to {width} bytes")
        size = math.prod(shape) * width
        spans.append((offset, offset + size))
        offset += size
    if not spans:
        raise TensorPayloadError("a flattened bucket needs at least one tensor")
    return spans


def adjacent_bytes(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One uint8 view over all tensors if they already lie back to back, in this order, in one
    storage (a flat parameter buffer); else None. Sending or receiving it needs no copy."""
    first = tensors[0]
    if not first.is_contiguous():
        return None
    storage = first.untyped_storage()
    end = first.data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() != end or t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        end += nbytes(t)
    start = first.data_ptr() - storage.data_ptr()
    total = end - first.data_ptr()
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (total,))


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two 1-D uint8 tensors of one size, viewed as the widest integer
    type their size and offsets allow: torch copies 1-byte elements ~15 % slower than 4 or 8."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        w = dtype.itemsize
        if dst.numel() % w == 0 and dst.storage_offset() % w == 0 and src.storage_offset() % w == 0:
            dst.view(dtype).copy_(src.view(dtype))
            return
    dst.copy_(src)


def flatten_parameters(module: torch.nn.Module, shapes: dict[str, torch.Size] | None = None) -> None:
    """Lay a module's parameters back to back in one buffer per dtype, in ``named_parameters``
    order (the order a trainer sends them in), so a flattened bucket of them is a view: sent
    or received with no copy (see ``adjacent_bytes``). The Parameter objects stay (tied weights
    too). ``shapes``: allocate those shapes uninitialised instead of keeping the values."""
    params = list(module.named_parameters())  # tied weights once
    for dtype in dict.fromkeys(p.dtype for _, p in params):
        group = [(n, p) for n, p in params if p.dtype == dtype]
        want = [p.shape if shapes is None else shapes[n] for n, p in group]
        flat = torch.empty(sum(math.prod(s) for s in want), dtype=dtype, device=group[0][1].device)
        offset = 0
        for (_, p), shape in zip(group, want):
            size = math.prod(shape)
            view = flat[offset : offset + size].view(shape)
            if shapes is None:
                view.copy_(p.data)
            p.data = view
            offset += size


def flatten_into(tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the tensors back to back into ``out`` (uint8, at least their size); return the used part."""
    total = sum(nbytes(t) for t in tensors)
    flat = out[:total]
    offset = 0
    for t in tensors:  # copy_ per tensor: a non-contiguous source is read in place, not cloned
        n = nbytes(t)
        flat[offset : offset + n].view(t.dtype).view(t.shape).copy_(t)
        offset += n
    return flat


def unflatten(flat: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views of each tensor in a received flattened bucket (no copy)."""
    return [
        flat[start:end].view(dtype).view(shape)
        for (start, end), dtype, shape in zip(flat_layout(dtypes, shapes), dtypes, shapes)
    ]


# ------------------------------------------------------------------ sender

_STRATEGY_LOCK = threading.Lock()


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    with _STRATEGY_LOCK:
        before = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            torch_mp.set_sharing_strategy(before)


def _dump(obj: Any, shared: list[torch.Tensor], receivers: int) -> str:
    """base64 of a ForkingPickler dump of ``obj``, whose tensors are ``shared``; ``receivers``:
    how many processes unpickle this one payload (every TP rank of every engine)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buf).dump(obj)
    # Pickling a shared CPU storage counts one reference and every unpickling drops one; with
    # more than one receiver the count would reach zero early and unlink a segment the sender
    # keeps using (a staging buffer, shared weights), so count the other receivers too.
    for t in shared:
        if not t.is_cuda:
            for _ in range(receivers - 1):
                t.untyped_storage()._shared_incref()
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_named_tensors(
    named_tensors: list[tuple[str, torch.Tensor]], clone: bool = True, receivers: int = 1
) -> tuple[str, list[torch.Tensor]]:
    """SGLang's default payload, [(name, tensor), ...] (what its own clients send; the senders
    here send flattened buckets). Returns (base64 payload, the tensors that must stay alive until
    the engine has loaded them). ``clone=False``: the tensors are pickled as they are, for CPU
    tensors already in shared memory or CUDA tensors the caller keeps unchanged until the
    engines answered."""
    if clone:
        keep = [t.detach().clone(memory_format=torch.contiguous_format) for _, t in named_tensors]
    else:
        keep = [t.detach() for _, t in named_tensors]
    return _dump([(name, t) for (name, _), t in zip(named_tensors, keep)], keep, receivers), keep


def serialize_flat_bucket(flat: torch.Tensor, names: list[str], tensors: list[torch.Tensor], receivers: int = 1) -> str:
    """SGLang's ``flattened_bucket`` payload for ``/update_weights_from_tensor``: ``flat`` (uint8,
    ``tensors``' bytes back to back, in shared memory or on a GPU: it travels as a handle, and
    must stay unchanged until the engines answered) and per tensor its name, shape, dtype and
    byte span. The metadata are ``SimpleNamespace``s with the fields of SGLang's
    ``FlattenedTensorMetadata``, which its safe unpickler accepts; no SGLang import here."""
    spans = flat_layout([t.dtype for t in tensors], [list(t.shape) for t in tensors])
    metadata = [
        SimpleNamespace(name=n, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=end, numel=end - start)
        for n, t, (start, end) in zip(names, tensors, spans)
    ]
    return _dump({"flattened_tensor": flat, "metadata": metadata}, [flat], receivers)


def share_memory_by_name(module: torch.nn.Module) -> None:
    """Move a CPU module's parameters into shared memory that any process of this user can map
    (the "file_system" strategy): a colocated push then sends their handles as they are, and each
    engine copies the bytes once. Do it before building the optimizer (storages move)."""
    with _file_system_sharing():
        module.share_memory()


def sendable_as_is(tensors: list[torch.Tensor]) -> bool:
    """A colocated bucket that needs no packing: the tensors lie back to back in one storage, in
    this order (``flatten_parameters``), in shared memory (``share_memory_by_name``) or on a GPU."""
    flat = adjacent_bytes(tensors)
    return flat is not None and (flat.is_cuda or flat.is_shared())


class SharedStaging:
    """A host buffer in shared memory, kept between pushes: a bucket is copied into it once and
    the engines map it by name. A fresh segment per bucket would cost a shm allocation and a page
    fault per 4 KiB on both sides, as much as the copy itself; a kept one is mapped once by each
    engine (which holds on to it, see ``rlhpc.engine_server.cpu``)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors copied back to back into the buffer (in this order); returns that part of it."""
        total = sum(nbytes(t) for t in tensors)
        if self._buf is None or self._buf.numel() < total:
            self._buf = None  # drop the old segment before mapping a bigger one
            buf = torch.empty(total, dtype=torch.uint8)
            with _file_system_sharing():
                buf.share_memory_()
            self._buf = buf
        return flatten_into(tensors, self._buf)

    def close(self) -> None:
        self._buf = None


# ------------------------------------------------------------------ receiver

# Only what torch's ForkingPickler emits for CPU tensors shared through the "file_system"
# strategy (see serialize_named_tensors), and for CUDA tensors on a GPU engine, may be
# unpickled: the body arrives over HTTP, and plain pickle would run whatever it names.
_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("types", "SimpleNamespace"),  # a flattened bucket's metadata (serialize_flat_bucket)
}
_REFUSED_GLOBALS = {
    "rebuild_storage_fd": "the sender shared tensors by file descriptor, which only its own child "
    "processes can open; serialise with the 'file_system' sharing strategy",
    "rebuild_cuda_tensor": "CUDA tensors cannot be loaded by the CPU engine (start it with --device cuda)",
}
_CUDA_GLOBAL = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")


# What a payload may call (REDUCE) and set state on (BUILD): finding a class is not calling it
# (``UntypedStorage(10**12)`` would allocate a terabyte), and a BUILD on a class found by name is
# a process-wide setattr (measured: one request broke every later weight push). As torch's
# ``weights_only`` unpickler, the pure-Python Unpickler with those two opcodes checked: the
# tensors' bytes travel in shared memory, so a payload is a few hundred bytes a tensor.
_CALLABLE = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch", "Size"),
    ("types", "SimpleNamespace"),
}
_STATE_SETTABLE = (SimpleNamespace,)


class TensorUnpickler(pickle._Unpickler):
    """Unpickles named tensors and nothing else; ``allow_cuda`` lets CUDA IPC handles through."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: io.BytesIO, allow_cuda: bool):
        super().__init__(file)
        self.allow_cuda = allow_cuda

    def load_reduce(self) -> None:
        func = self.stack[-2]
        if (getattr(func, "__module__", None), getattr(func, "__qualname__", None)) not in _CALLABLE:
            raise TensorPayloadError(f"refusing to call {getattr(func, '__qualname__', func)!r} from a weight payload")
        pickle._Unpickler.load_reduce(self)

    def load_build(self) -> None:
        target = self.stack[-2]
        if type(target) not in _STATE_SETTABLE:
            raise TensorPayloadError(f"refusing to set state on {type(target).__name__} from a weight payload")
        pickle._Unpickler.load_build(self)

    def load_newobj(self) -> None:
        raise TensorPayloadError("refusing NEWOBJ in a weight payload: objects are built by their rebuild functions")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj
    dispatch[pickle.INST[0]] = load_newobj
    dispatch[pickle.OBJ[0]] = load_newobj

    def find_class(self, module: str, name: str) -> Any:
        if (
            (module, name) in _ALLOWED_GLOBALS
            or (self.allow_cuda and (module, name) == _CUDA_GLOBAL)
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        ):
            return super().find_class(module, name)
        if name in _REFUSED_GLOBALS:
            raise TensorPayloadError(_REFUSED_GLOBALS[name])
        raise TensorPayloadError(f"refusing to unpickle {module}.{name} from a weight payload")


def _load(payload: str, allow_cuda: bool) -> Any:
    try:
        raw = base64.b64decode(payload, validate=True)
        return TensorUnpickler(io.BytesIO(raw), allow_cuda).load()
    except TensorPayloadError:
        raise
    except Exception as e:
        raise TensorPayloadError(f"cannot read serialized_named_tensors: {type(e).__name__}: {e}") from e


def deserialize_named_tensors(payload: str, allow_cuda: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Unpickle [(name, tensor), ...]; ``allow_cuda`` lets CUDA IPC handles through (GPU engine)."""
    named = _load(payload, allow_cuda)
    if not isinstance(named, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor) for x in named
    ):
        raise TensorPayloadError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return named


def deserialize_flat_bucket(payload: str, allow_cuda: bool = False) -> list[tuple[str, torch.Tensor]]:
    """A ``flattened_bucket`` payload as views of each named tensor in its flat tensor (no copy);
    every span must lie inside it and hold its shape and dtype, aligned to its element size."""
    obj = _load(payload, allow_cuda)
    flat = obj.get("flattened_tensor") if isinstance(obj, dict) else None
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(flat, torch.Tensor) or not isinstance(metadata, list):
        raise TensorPayloadError("a flattened_bucket payload holds {'flattened_tensor': tensor, 'metadata': [...]}")
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise TensorPayloadError(f"flattened_tensor must be 1-D uint8, not {flat.dtype} of shape {list(flat.shape)}")
    named = []
    for m in metadata:
        try:
            name, shape, dtype, start, end = m.name, torch.Size(m.shape), m.dtype, int(m.start_idx), int(m.end_idx)
        except (AttributeError, TypeError, ValueError) as e:
            raise TensorPayloadError(f"bad flattened_bucket metadata {m!r}: {e}") from e
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise TensorPayloadError(f"bad flattened_bucket metadata {m!r}: name must be a str, dtype a torch.dtype")
        if (
            not 0 <= start <= end <= flat.numel()
            or end - start != shape.numel() * dtype.itemsize
            or start % dtype.itemsize
        ):
            raise TensorPayloadError(
                f"{name}: bytes {start}..{end} of a {flat.numel()}-byte bucket do not hold an aligned {dtype} "
                f"tensor of shape {list(shape)}"
            )
        named.append((name, flat[start:end].view(dtype).view(shape)))
    return named
