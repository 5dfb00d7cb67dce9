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
import os
import pickle
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions as torch_reductions


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


def _uuid_of(device: int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def with_device_uuid(args: tuple, uuid_of: Any = _uuid_of) -> tuple:
    """``rebuild_cuda_tensor``'s arguments with the sender's device index (argument 6) replaced
    by that GPU's UUID, as SGLang's ``monkey_patch_torch_reductions`` sends it: each receiving
    rank maps it to its own index for that GPU (``_device_from_uuid``), whatever
    ``CUDA_VISIBLE_DEVICES`` numbers it there; an index would name the receiver's GPU of that number."""
    return (*args[:6], uuid_of(args[6]), *args[7:])


def _reduce_tensor(t: torch.Tensor) -> tuple:
    fn, args = torch_reductions.reduce_tensor(t)
    return (fn, with_device_uuid(args)) if fn is torch_reductions.rebuild_cuda_tensor else (fn, args)


def _dump(obj: Any) -> str:
    """base64 of a ForkingPickler dump of ``obj`` for ONE receiving process: pickling counts one
    reference on each shared storage (CPU shared memory, or a CUDA IPC block) and that process's
    unpickling drops it, so every TP rank of every engine gets a dump of its own (as SGLang's
    clients send one per rank: another rank's copy would unbalance the count, and a CUDA block
    would never be freed). CUDA devices travel as UUIDs (``with_device_uuid``)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    with _file_system_sharing():
        pickler = ForkingPickler(buf)
        pickler.dispatch_table[torch.Tensor] = _reduce_tensor  # this pickler's table: torch's stays as it is
        pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_named_tensors(
    named_tensors: list[tuple[str, torch.Tensor]], clone: bool = True
) -> tuple[str, list[torch.Tensor]]:
    """SGLang's default payload, [(name, tensor), ...] (what its own clients send; the senders
    here send flattened buckets), for one receiving process. Returns (base64 payload, the tensors
    that must stay alive until the engine has loaded them). ``clone=False``: the tensors are
    pickled as they are, for CPU tensors already in shared memory or CUDA tensors the caller
    keeps unchanged until the engines answered."""
    if clone:
        keep = [t.detach().clone(memory_format=torch.contiguous_format) for _, t in named_tensors]
    else:
        keep = [t.detach() for _, t in named_tensors]
    return _dump([(name, t) for (name, _), t in zip(named_tensors, keep)]), keep


def serialize_tensor_dict(named_tensors: dict[str, torch.Tensor]) -> tuple[str, list[torch.Tensor]]:
    """A LoRA adapter's payload for ``/load_lora_adapter_from_tensors`` (SGLang reads it as
    {name: tensor}), for one receiving process, as ``serialize_named_tensors`` (cloned)."""
    keep = {n: t.detach().clone(memory_format=torch.contiguous_format) for n, t in named_tensors.items()}
    return _dump(keep), list(keep.values())


def serialize_flat_bucket(
    flat: torch.Tensor, names: list[str], tensors: list[torch.Tensor], ranks: int = 1
) -> list[str]:
    """SGLang's ``flattened_bucket`` payload for ``/update_weights_from_tensor``, one per
    receiving TP rank (``serialized_named_tensors[tp_rank]``, see ``_dump``): ``flat`` (uint8,
    ``tensors``' bytes back to back, in shared memory or on a GPU: it travels as a handle, and
    must stay unchanged until the engines answered) and per tensor its name, shape, dtype and
    byte span. The metadata are ``SimpleNamespace``s with the fields of SGLang's
    ``FlattenedTensorMetadata``, which its safe unpickler accepts; no SGLang import here."""
    spans = flat_layout([t.dtype for t in tensors], [list(t.shape) for t in tensors])
    metadata = [
        SimpleNamespace(name=n, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=end, numel=end - start)
        for n, t, (start, end) in zip(names, tensors, spans)
    ]
    return [_dump({"flattened_tensor": flat, "metadata": metadata}) for _ in range(ranks)]


def non_finite(
    flat: torch.Tensor, dtypes: list[torch.dtype], spans: list[tuple[int, int]], names: list[str]
) -> list[str]:
    """Names of the tensors of a flattened bucket that hold NaN or an infinity: one read of the
    bucket where it lies (a sum per run of one floating dtype, NaN and infinities carry through
    a sum; one sync on a GPU). Only a run whose sum is not finite is looked at tensor by tensor
    (a sum of finite values can overflow, e.g. float16's: those tensors pass)."""
    runs: list[tuple[torch.dtype, int, int]] = []  # (dtype, first tensor, end tensor)
    for k, dtype in enumerate(dtypes):
        # FP8 values (rollout.quantization: fp8) cannot be summed; their float32 block scales,
        # sent beside them, carry any NaN or infinity of the weights they were quantized from
        if not dtype.is_floating_point or dtype.itemsize == 1:
            continue
        if runs and runs[-1][0] == dtype and runs[-1][2] == k:
            runs[-1] = (dtype, runs[-1][1], k + 1)
        else:
            runs.append((dtype, k, k + 1))
    if not runs:
        return []
    sums = torch.stack([flat[spans[a][0] : spans[b - 1][1]].view(dtype).sum().float() for dtype, a, b in runs])
    finite = sums.isfinite().tolist()
    return [
        names[k]
        for (dtype, a, b), ok in zip(runs, finite)
        if not ok
        for k in range(a, b)
        if not bool(flat[spans[k][0] : spans[k][1]].view(dtype).isfinite().all())
    ]


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

# A payload arrives over HTTP and plain pickle would run whatever it names. Torch's ForkingPickler
# output for a shared CPU tensor (or a CUDA IPC handle on a GPU engine) names a handful of
# globals, and the unpickler below hands out for each only an object that is safe whatever the
# payload does with it: the rebuild functions behind wrappers that check their arguments, the
# classes passed to them as tokens that cannot be called or changed, ``torch.Size`` and the dtypes
# (immutable), and for a flattened bucket's ``SimpleNamespace`` metadata a class with exactly
# its six fields, set once. That holds for every opcode, so the C unpickler (``pickle.Unpickler``)
# can run it: only ``find_class`` is hooked, no opcode needs checking. (Allowing a real class and
# checking REDUCE and BUILD was not enough: a BUILD on an allowed SimpleNamespace set its
# ``append`` to a class, and APPEND then called it, allocating what the payload asked.)


class _Frozen:
    """No attribute can be set or added after construction (a BUILD's slot state is a setattr)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise TensorPayloadError(f"refusing to set {name!r} on {self!r} from a weight payload")


class _ClassToken(_Frozen):
    """Stands for a class a payload names as an argument of a rebuild function; never the class."""

    __slots__ = ("cls",)

    def __init__(self, cls: type):
        object.__setattr__(self, "cls", cls)

    def __repr__(self) -> str:
        return f"<{self.cls.__module__}.{self.cls.__qualname__} as named in a payload>"


_TENSOR = _ClassToken(torch.Tensor)
_UNTYPED_STORAGE = _ClassToken(torch.UntypedStorage)
_TYPED_STORAGE = _ClassToken(torch.TypedStorage)


def _cls(token: Any, *allowed: _ClassToken) -> Any:
    if not any(token is t for t in allowed):
        raise TensorPayloadError(f"a rebuild function got {token!r}, not one of {list(allowed)}")
    return token.cls


def _int(x: Any, what: str) -> int:
    if type(x) is not int or x < 0:
        raise TensorPayloadError(f"{what} must be a non-negative int, not {x!r}")
    return x


def _ints(xs: Any, what: str) -> tuple[int, ...]:
    if not isinstance(xs, tuple) or not all(type(x) is int and x >= 0 for x in xs):
        raise TensorPayloadError(f"{what} must be a tuple of non-negative ints, not {xs!r}")
    return xs


def _shm_segment(manager: Any, handle: Any, size: int) -> None:
    """A "file_system" share names torch's shm manager socket and a /dev/shm segment: both must
    be torch's and this user's, and the segment hold the declared size (mapping past its end
    would crash the engine on the first read)."""
    if type(manager) is not bytes or type(handle) is not bytes:
        raise TensorPayloadError("a shared storage's manager and handle must be bytes")
    if not re.fullmatch(rb"/torch_\d+_\d+_\d+", handle):
        raise TensorPayloadError(f"{handle!r} does not name a torch shared-memory segment")
    sock = os.fsdecode(manager)
    if os.path.basename(sock) != "manager.sock" or not os.path.basename(os.path.dirname(sock)).startswith(
        "torch-shm-dir-"
    ):
        raise TensorPayloadError(f"{sock!r} is not torch's shared-memory manager socket")
    try:
        st = os.stat(b"/dev/shm" + handle)
    except OSError as e:
        raise TensorPayloadError(f"shared-memory segment {handle.decode()}: {e.strerror}") from e
    if st.st_uid != os.getuid() or st.st_size < size:
        raise TensorPayloadError(
            f"shared-memory segment {handle.decode()} is not this user's or holds fewer than {size} bytes"
        )


def _rebuild_tensor(cls: Any, storage: Any, metadata: Any) -> torch.Tensor:
    _cls(cls, _TENSOR)
    if not isinstance(storage, torch.TypedStorage):
        raise TensorPayloadError(f"rebuild_tensor got a {type(storage).__name__}, not a storage")
    if not (isinstance(metadata, tuple) and len(metadata) == 4):
        raise TensorPayloadError("rebuild_tensor's metadata must be (offset, size, stride, requires_grad)")
    offset, size, stride, requires_grad = metadata
    _int(offset, "a tensor's offset")
    _ints(tuple(size) if isinstance(size, torch.Size) else size, "a tensor's size")
    _ints(stride, "a tensor's stride")
    if requires_grad is not False:
        raise TensorPayloadError("a pushed weight must not require grad")
    return torch_reductions.rebuild_tensor(torch.Tensor, storage, metadata)  # set_ checks the bounds


def _rebuild_typed_storage(storage: Any, dtype: Any) -> torch.TypedStorage:
    if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise TensorPayloadError("rebuild_typed_storage takes an untyped storage and a dtype")
    return torch_reductions.rebuild_typed_storage(storage, dtype)


def _rebuild_storage_filename(cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> Any:
    _cls(cls, _UNTYPED_STORAGE)
    if dtype is not None:
        raise TensorPayloadError("a shared storage comes untyped")
    _shm_segment(manager, handle, _int(size, "a shared storage's size"))
    return torch_reductions.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size)


def _rebuild_storage_empty(cls: Any) -> Any:
    return _cls(cls, _UNTYPED_STORAGE)()


def _device_from_uuid(device: Any) -> int:
    """The local index of the GPU a sender named by UUID (``cuda_reducer``), as SGLang's
    ``monkey_patch_torch_reductions`` maps it; a bare index is the sender's own numbering."""
    if type(device) is int:
        return device
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(index).uuid) == device:
                return index
    raise TensorPayloadError(f"no GPU here has the UUID {device!r} the payload names")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    if len(args) != 15:
        raise TensorPayloadError("rebuild_cuda_tensor takes 15 arguments")
    args = (_cls(args[0], _TENSOR), *args[1:4], _cls(args[4], _TYPED_STORAGE, _UNTYPED_STORAGE), *args[5:])
    _ints(tuple(args[1]), "a tensor's size")
    _ints(args[2], "a tensor's stride")
    if not isinstance(args[5], torch.dtype) or args[10] is not False:
        raise TensorPayloadError("a CUDA tensor needs a dtype and must not require grad")
    args = (*args[:6], _device_from_uuid(args[6]), *args[7:])
    return torch_reductions.rebuild_cuda_tensor(*args)


class _Rebuild(_Frozen):
    """A rebuild function a payload may call, with any arguments: its wrapper checks them."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any):
        object.__setattr__(self, "fn", fn)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"<{self.fn.__name__.lstrip('_')} for a weight payload>"


class BucketMetadata(_Frozen):
    """A flattened bucket's per-tensor metadata as it arrives (the sender pickles a
    ``SimpleNamespace``): its six fields, set once, and nothing else."""

    FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
    __slots__ = FIELDS

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != set(self.FIELDS) or hasattr(self, "name"):
            raise TensorPayloadError(f"flattened_bucket metadata must set {self.FIELDS} once")
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def __repr__(self) -> str:
        return f"BucketMetadata({', '.join(f'{k}={getattr(self, k, None)!r}' for k in self.FIELDS)})"


_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _Rebuild(_rebuild_tensor),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _Rebuild(_rebuild_typed_storage),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _Rebuild(_rebuild_storage_filename),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _Rebuild(_rebuild_storage_empty),
    ("torch", "Tensor"): _TENSOR,
    ("torch.storage", "UntypedStorage"): _UNTYPED_STORAGE,
    ("torch.storage", "TypedStorage"): _TYPED_STORAGE,
    ("torch", "Size"): torch.Size,  # an immutable tuple of ints
    ("types", "SimpleNamespace"): BucketMetadata,  # a flattened bucket's metadata (serialize_flat_bucket)
}
_GLOBALS.update(
    {("torch", str(d).removeprefix("torch.")): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
)
_CUDA_GLOBAL = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
_CUDA_REBUILD = _Rebuild(_rebuild_cuda_tensor)
_REFUSED_GLOBALS = {
    "rebuild_storage_fd": "the sender shared tensors by file descriptor, which only its own child "
    "processes can open; serialise with the 'file_system' sharing strategy",
    "rebuild_cuda_tensor": "CUDA tensors cannot be loaded by the CPU engine (start it with --device cuda)",
}


class TensorUnpickler(pickle.Unpickler):
    """Unpickles named tensors and nothing else (see above); ``allow_cuda`` lets CUDA IPC handles through."""

    def __init__(self, file: io.BytesIO, allow_cuda: bool):
        super().__init__(file)
        self.allow_cuda = allow_cuda

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is not None:
            return found
        if self.allow_cuda and (module, name) == _CUDA_GLOBAL:
            return _CUDA_REBUILD
        if module == "torch.multiprocessing.reductions" and name in _REFUSED_GLOBALS:
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


def deserialize_tensor_dict(payload: str, allow_cuda: bool = False) -> dict[str, torch.Tensor]:
    """Unpickle {name: tensor} (``serialize_tensor_dict``), with the same checks as a weight push."""
    named = _load(payload, allow_cuda)
    if not isinstance(named, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in named.items()
    ):
        raise TensorPayloadError("serialized_named_tensors must hold a dict of {name: tensor}")
    return named


@dataclass
class FlatBucket:
    """A received flattened bucket: its bytes and each tensor's name, dtype, shape and byte span
    in them, checked to lie inside and aligned (``deserialize_flat_bucket``)."""

    flat: torch.Tensor
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[torch.Size]
    spans: list[tuple[int, int]]

    def back_to_back(self) -> torch.Tensor | None:
        """The bytes of all tensors, when they lie back to back from the start in this order (as
        senders lay them out, ``flat_layout``): one copy lands them in parameters laid out alike."""
        end = 0
        for start, stop in self.spans:
            if start != end:
                return None
            end = stop
        return self.flat[:end]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Views of each named tensor (no copy)."""
        return [
            (name, self.flat[start:end].view(dtype).view(shape))
            for name, dtype, shape, (start, end) in zip(self.names, self.dtypes, self.shapes, self.spans)
        ]


def deserialize_flat_bucket(payload: str, allow_cuda: bool = False) -> FlatBucket:
    """A ``flattened_bucket`` payload: every span must lie inside its flat tensor and hold its
    shape and dtype, aligned to its element size (what SGLang's receiver checks)."""
    obj = _load(payload, allow_cuda)
    flat = obj.get("flattened_tensor") if isinstance(obj, dict) else None
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(flat, torch.Tensor) or not isinstance(metadata, list):
        raise TensorPayloadError("a flattened_bucket payload holds {'flattened_tensor': tensor, 'metadata': [...]}")
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise TensorPayloadError(f"flattened_tensor must be 1-D uint8, not {flat.dtype} of shape {list(flat.shape)}")
    size = flat.numel()
    bucket = FlatBucket(flat, [], [], [], [])
    for m in metadata:
        try:
            name, shape, dtype, start, end = m.name, torch.Size(m.shape), m.dtype, int(m.start_idx), int(m.end_idx)
        except (AttributeError, TypeError, ValueError) as e:
            raise TensorPayloadError(f"bad flattened_bucket metadata {m!r}: {e}") from e
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise TensorPayloadError(f"bad flattened_bucket metadata {m!r}: name must be a str, dtype a torch.dtype")
        if not 0 <= start <= end <= size or end - start != shape.numel() * dtype.itemsize or start % dtype.itemsize:
            raise TensorPayloadError(
                f"{name}: bytes {start}..{end} of a {size}-byte bucket do not hold an aligned {dtype} "
                f"tensor of shape {list(shape)}"
            )
        bucket.names.append(name)
        bucket.dtypes.append(dtype)
        bucket.shapes.append(shape)
        bucket.spans.append((start, end))
    return bucket
