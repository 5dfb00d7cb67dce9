"""The colocated channel (``TensorWeightSender``): engines on the trainer's node, by handle.

Each bucket travels as ONE handle (shared memory, or CUDA IPC on a GPU) inside
``/update_weights_from_tensor``, ``load_format="flattened_bucket"`` (``rlhpc.weights.tensor_transport``):
of the buffer the bucket is packed into (on CPU a shared-memory segment kept between pushes, on a
GPU a device buffer for the push), or, for weights already lying flat in shared memory or on the
GPU, of the weights as they are. Each TP rank of each engine gets a pickle of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future

import torch

from rlhpc.weights.base import SenderBase, in_flat_order, run_now
from rlhpc.weights.tensor_transport import (
    SharedStaging,
    adjacent_bytes,
    flatten_into,
    nbytes,
    sendable_as_is,
    serialize_flat_bucket,
)
from rlhpc.wire import protocol as P
from rlhpc.wire.client import EngineClient
from rlhpc.wire.protocol import FLATTENED_BUCKET

log = logging.getLogger(__name__)


class TensorWeightSender(SenderBase):
    """Colocated engines (same node): each bucket as one flat tensor passed by handle (shared
    memory on CPU, CUDA IPC on a GPU), no bytes over HTTP; each engine copies it once.

    A bucket already lying flat in one storage (``flatten_parameters``; on CPU also in shared
    memory, ``share_memory_by_name``) goes as it is. Any other is packed: on CPU into a
    shared-memory segment kept between pushes (the engines map it once); on a GPU into one
    device buffer per push, given back after it (an offloaded actor leaves the GPU to the
    engines between pushes). While the engines load a bucket, the next one is checked
    (``SenderBase._checked``) when it needs no packing into the buffer they read."""

    def __init__(self, clients: list[EngineClient], engine_world_sizes: list[int], bucket_bytes: int):
        super().__init__(clients, engine_world_sizes, bucket_bytes)
        self._staging = SharedStaging()

    def _send_buckets(self, buckets: Iterator[tuple[list[tuple[str, torch.Tensor]], bool]], version: str) -> int:
        n = 0
        device_buf: torch.Tensor | None = None  # a GPU bucket's packing buffer, for this push
        posts: list[Future] = []  # the engines' loads of the previous bucket
        for bucket, last in buckets:
            names, tensors = in_flat_order(bucket)
            if sendable_as_is(tensors):
                flat = adjacent_bytes(tensors)
            else:
                self._collect(posts)  # the engines are done with the buffer: pack it again
                posts = []
                if tensors[0].device.type == "cpu":
                    flat = self._staging.pack(tensors)
                else:
                    total = sum(nbytes(t) for t in tensors)
                    if device_buf is None or device_buf.numel() < total:
                        device_buf = None  # back to the allocator before a bigger one
                        device_buf = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
                    flat = flatten_into(tensors, device_buf)
            self._checked(flat, names, tensors)  # beside the engines' load of the previous bucket
            self._collect(posts)  # in order: an engine takes one bucket after the other
            # the last bucket to one engine: no thread hop, nothing to check beside it
            submit = run_now if last and len(self.clients) == 1 else self._pool.submit
            posts = [
                submit(
                    self._update,
                    c,
                    c.update_weights_from_tensor,
                    P.UpdateWeightsFromTensorReqInput(
                        serialized_named_tensors=serialize_flat_bucket(flat, names, tensors, ranks=tp),
                        load_format=FLATTENED_BUCKET,
                        flush_cache=last,
                        weight_version=version if last else None,
                    ),
                )
                for c, tp in zip(self.clients, self.engine_world_sizes)
            ]
            n += 1
        self._collect(posts)  # every engine has copied the last bucket out
        if device_buf is not None:
            del device_buf, flat
            torch.cuda.ipc_collect()  # free it once the engines have closed their handles
        return n

    def _collect(self, posts: list[Future]) -> None:
        if posts:
            self._last_answers = [self._result(f, c) for f, c in zip(posts, self.clients)]

    def close(self) -> None:
        self._staging.close()
        super().close()
