"""The disaggregated channel (``DistributedWeightSender``): a broadcast group to the engines' GPUs.

The trainer's rank 0 and every engine GPU form one extra torch.distributed group (trainer = rank
0, engine e's TP ranks start at ``1 + sum(tp sizes before e)``, ``rlhpc.weights.update_group``);
each bucket of tensors is announced over HTTP (``/update_weights_from_distributed``,
``load_format="flattened_bucket"``) and broadcast from rank 0 as ONE flat tensor (SGLang's
FlattenedTensorBucket layout); the next bucket is packed while this one is on the wire.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import timedelta

import torch
import torch.distributed as dist

from rlhpc.errors import RlhpcError
from rlhpc.weights.base import DEFAULT_GROUP_NAME, Packed, SenderBase, dtype_name, in_flat_order
from rlhpc.weights.tensor_transport import (
    adjacent_bytes,
    flatten_into,
    nbytes,
)
from rlhpc.weights.update_group import (
    DEFAULT_TIMEOUT,
    RendezvousStore,
    as_timedelta,
    create_master_store,
    formed_at_creation,
    init_custom_process_group,
    is_open,
    open_groups_named,
)
from rlhpc.wire import protocol as P
from rlhpc.wire.client import EngineClient
from rlhpc.wire.protocol import FLATTENED_BUCKET

log = logging.getLogger(__name__)


class DistributedWeightSender(SenderBase):
    """Disaggregated engines: one broadcast group, trainer rank 0, one rank per engine GPU.

    No bucket is announced before every engine has answered the session's begin: announced to
    a dead engine's peers, the live ones would join a broadcast it can never complete and sit
    in it until the group timeout, deaf to the reconnect that follows its restart."""

    def __init__(
        self,
        clients: list[EngineClient],
        engine_world_sizes: list[int],
        master_address: str,
        backend: str,
        bucket_bytes: int,
        group_name: str = DEFAULT_GROUP_NAME,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
    ):
        super().__init__(clients, engine_world_sizes, bucket_bytes)
        self.master_address = master_address
        self.backend = backend
        self.group_name = group_name
        self.timeout = as_timedelta(timeout)
        self.world_size = 1 + sum(self.engine_world_sizes)
        self.rank_offsets = [1 + sum(self.engine_world_sizes[:e]) for e in range(len(clients))]
        self.master_port: int | None = None
        self._store: RendezvousStore | None = None
        self._group: dist.ProcessGroup | None = None
        self._broken: str | None = None  # a broadcast left hanging: the group is unusable
        self._bcast_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-bcast")
        self._buffers: list[torch.Tensor | None] = [None, None]  # host packing buffers, alternating

    def _check_tp_sizes(self) -> None:
        infos = self._on_all(lambda c: c.get_server_info())
        for c, info, want in zip(self.clients, infos, self.engine_world_sizes):
            got = info.get("tp_size")
            if got is not None and int(got) != want:
                raise RlhpcError(
                    f"engine {c.base_url} runs with tp_size={got} but weight sync was given {want}",
                    "pass each engine's real TP size (a CPU engine server is always 1)",
                )

    def connect(self) -> None:
        if self._group is not None:
            return
        self._check_tp_sizes()
        self._drop_stale_groups()
        self._store = create_master_store(self.master_address, self.world_size, self.timeout)
        self.master_port = self._store.port
        log.info(
            "weight sync group %r: %s:%d, world %d",
            self.group_name,
            self.master_address,
            self.master_port,
            self.world_size,
        )
        joins = [
            self._pool.submit(
                c.init_weights_update_group,
                P.InitWeightsUpdateGroupReqInput(
                    master_address=self.master_address,
                    master_port=self.master_port,
                    rank_offset=off,
                    world_size=self.world_size,
                    group_name=self.group_name,
                    backend=self.backend,
                ),
            )
            for c, off in zip(self.clients, self.rank_offsets)
        ]
        # Our own join blocks until every rank arrived; run it aside so an engine that refuses
        # (bad backend, name clash) fails connect() at once instead of after the group timeout.
        own = self._pool.submit(
            init_custom_process_group,
            self.backend,
            self.master_address,
            self.master_port,
            0,
            self.world_size,
            self.group_name,
            self.timeout,
            self._store,
        )
        for f, c in zip(joins, self.clients):
            self._result(f, c)
        self._group = own.result(timeout=self.timeout.total_seconds())
        # every engine has answered, so has built its end: the port need not listen any longer
        if formed_at_creation(self.backend):
            self._close_store()

    def _close_store(self) -> None:
        if self._store is not None and not self._store.closed:
            self._store.close()
            log.info("weight sync group %r formed; rendezvous port %d closed", self.group_name, self.master_port)

    def _drop_stale_groups(self) -> None:
        """Make connect() repeatable: a trainer that restarted, or a sender never closed, leaves
        a group of this name behind (engines, and SGLang, refuse to create one twice)."""
        for c in self.clients:
            with contextlib.suppress(RlhpcError):  # no such group: the normal case
                c.destroy_weights_update_group(self.group_name)
        for pg in open_groups_named(self.group_name):
            log.warning("replacing weight sync group %r left open in this process", self.group_name)
            dist.destroy_process_group(pg)

    def _check_ready(self) -> None:
        if self._broken:
            raise RlhpcError(f"weight sync group unusable: {self._broken}", "restart the engines and connect again")
        if self._group is None:
            raise RlhpcError("weight sync send() before connect()", "call connect() once after the engines are up")

    def _send_buckets(self, buckets: Iterator[tuple[list[tuple[str, torch.Tensor]], bool]], version: str) -> int:
        n = 0
        packed = self._pack(next(buckets, None), slot=0)
        while packed is not None:
            posts, bcast = self._start_bucket(packed, version)
            # pack bucket n + 1 into the other buffer while bucket n is on the wire
            try:
                following = self._pack(next(buckets, None), slot=(n + 1) % 2)
            except BaseException:
                with contextlib.suppress(Exception):
                    self._finish_bucket(posts, bcast)
                raise
            self._finish_bucket(posts, bcast)
            self._close_store()  # NCCL formed its communicator at this first broadcast
            packed, n = following, n + 1
        return n

    def _pack(self, item: tuple[list[tuple[str, torch.Tensor]], bool] | None, slot: int) -> Packed | None:
        """A bucket as one flat uint8 tensor in SGLang's flattened-bucket layout, checked (``_checked``).

        No copy when the bucket is one contiguous tensor, or tensors already back to back in one
        storage; else a copy into a buffer kept between sends (host memory handed back to the
        OS and faulted in again on every send costs as much as the copy itself)."""
        if item is None:
            return None
        bucket, last = item
        names, tensors = in_flat_order(bucket)
        flat = adjacent_bytes(tensors)
        if flat is None:
            total = sum(nbytes(t) for t in tensors)
            device = tensors[0].device
            buf = self._buffers[slot]
            if device.type != "cpu":
                buf = torch.empty(total, dtype=torch.uint8, device=device)  # the caching allocator reuses it
            elif buf is None or buf.numel() < total:
                buf = self._buffers[slot] = torch.empty(total, dtype=torch.uint8)
            flat = flatten_into(tensors, buf)
        self._checked(flat, names, tensors)  # beside the broadcast of the previous bucket
        return Packed(flat, names, [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors], last)

    def _start_bucket(self, packed: Packed, version: str) -> tuple[list[Future], Future]:
        """Announce the bucket to every engine (one POST each) and broadcast it (one broadcast)."""
        announce = P.UpdateWeightsFromDistributedReqInput(
            names=packed.names,
            dtypes=packed.dtypes,
            shapes=packed.shapes,
            group_name=self.group_name,
            flush_cache=packed.last,
            weight_version=version if packed.last else None,
            load_format=FLATTENED_BUCKET,
        )
        posts = [self._pool.submit(self._update, c, c.update_weights_from_distributed, announce) for c in self.clients]
        return posts, self._bcast_pool.submit(self._broadcast, packed.flat)

    def _finish_bucket(self, posts: list[Future], bcast: Future) -> None:
        # Watch the engines' answers beside the broadcast: an engine that refuses the bucket
        # (unknown group, bad name) never joins the broadcast, which would otherwise block us
        # for the whole group timeout before saying why.
        wait([bcast, *posts], return_when=FIRST_EXCEPTION)
        if bcast.done() and bcast.exception() is not None:
            wait(posts, timeout=10)  # an engine's answer explains a broken broadcast better than gloo
            self._broken = f"a broadcast failed: {bcast.exception()}"
        elif any(f.done() and f.exception() is not None for f in posts):
            # Refused after receiving everything (bad name or shape): the broadcast completes
            # and the group stays usable. Refused before: the broadcast can never complete.
            wait([bcast], timeout=5)
            if not bcast.done() or bcast.exception() is not None:
                self._broken = "an engine refused a bucket while the broadcast was under way"
        if self._broken:
            for f, c in zip(posts, self.clients):
                if f.done() and f.exception() is not None:
                    self._result(f, c)
            raise RlhpcError(
                f"weight broadcast to {[c.base_url for c in self.clients]} failed: {self._broken}",
                "check the engine logs, restart the engines and connect again",
            )
        self._last_answers = [self._result(f, c) for f, c in zip(posts, self.clients)]
        bcast.result()

    def _broadcast(self, flat: torch.Tensor) -> None:
        dist.broadcast(flat, group_src=0, group=self._group)

    def close(self) -> None:
        if self._group is not None:
            for c in self.clients:
                with contextlib.suppress(Exception):  # an engine already gone has no group left
                    # briefly: an engine whose node lost power never answers
                    c.destroy_weights_update_group(self.group_name, timeout_s=10)
            # never tear down a group a broadcast thread still blocks in, nor one a later
            # sender already replaced
            if not self._broken and is_open(self._group):
                dist.destroy_process_group(self._group)
            self._group = None
        self._close_store()
        self._store = None
        self._buffers = [None, None]
        self._bcast_pool.shutdown(wait=False, cancel_futures=True)
        super().close()
