"""Trainer -> engine weight sync over SGLang's own weight-update routes.

Two channels, chosen by placement:

- disaggregated (``DistributedWeightSender``): the trainer's rank 0 and every engine GPU form one
  extra torch.distributed group (trainer = rank 0, engine e's TP ranks start at
  ``1 + sum(tp sizes before e)``); each bucket of tensors is announced over HTTP
  (``/update_weights_from_distributed``, ``load_format="flattened_bucket"``) and broadcast from
  rank 0 as ONE flat tensor (SGLang's FlattenedTensorBucket layout); the next bucket is packed
  while this one is on the wire.
- colocate (``TensorWeightSender``): engines share the trainer's node, so each bucket travels as
  ONE handle (shared memory, or CUDA IPC on a GPU) inside ``/update_weights_from_tensor``,
  ``load_format="flattened_bucket"`` (see ``rlhpc.weights.tensor_transport``): of the buffer the
  bucket is packed into (on CPU a shared-memory segment kept between pushes, on a GPU a device
  buffer for the push), or, for weights already lying flat in shared memory or on the GPU, of
  the weights as they are.

Both pause generation first (a push of one bucket sends it with ``abort_all_requests`` instead),
open a weight-update session on every engine (``/begin_weight_update``: SGLang refuses updates
outside one), tag the last bucket with ``flush_cache`` and the new ``weight_version``, close the
session (``/end_weight_update``), check that every engine set that version (its answer to the last
bucket says so, as SGLang's does; else it is asked), then continue generation.
Only one trainer process (rank 0, holding full HF-named tensors) sends.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlhpc.errors import RlhpcError
from rlhpc.weights.tensor_transport import (
    SharedStaging,
    adjacent_bytes,
    flat_order,
    flatten_into,
    nbytes,
    sendable_as_is,
    serialize_flat_bucket,
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
from rlhpc.wire.protocol import FLATTENED_BUCKET, weight_version_note

log = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "rlhpc_weight_sync"


# ------------------------------------------------------------------ buckets


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's dtype strings: ``getattr(torch, name)`` on the engine side."""
    return str(dtype).removeprefix("torch.")


def in_flat_order(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list[str], list[torch.Tensor]]:
    """A bucket's names and tensors in flattened-bucket order (``flat_order``)."""
    tensors = [t.detach() for _, t in bucket]
    order = flat_order(tensors)
    return [bucket[i][0] for i in order], [tensors[i] for i in order]


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Yield ``(bucket, is_last)``; a bucket holds <= bucket_bytes unless one tensor is larger.

    One bucket of lookahead tells us which bucket is last without materialising the iterable.
    """
    if bucket_bytes <= 0:
        raise RlhpcError(f"weight sync bucket_bytes must be positive, got {bucket_bytes}", "set a bucket size in bytes")
    pending: list[tuple[str, torch.Tensor]] | None = None
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        n = nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            if pending is not None:
                yield pending, False
            pending, bucket, size = bucket, [], 0
        bucket.append((name, tensor))
        size += n
    if pending is not None:
        yield pending, not bucket
    if bucket:
        yield bucket, True


# ------------------------------------------------------------------ senders


def _done(fn: Callable[[EngineClient], Any], client: EngineClient) -> Future:
    """fn(client) run here, as a finished future (so errors are reported like the pool's)."""
    future: Future = Future()
    try:
        future.set_result(fn(client))
    except Exception as e:
        future.set_exception(e)
    return future


@dataclass
class _Packed:
    """One bucket ready for the wire: its bytes and the announce's metadata, in sending order."""

    flat: torch.Tensor
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    last: bool


class _SenderBase:
    # How generation is paused for a push: SGLang's default "abort" ends the requests in flight;
    # "retract" (rollout.partial_rollout) keeps them, to go on with the new weights after it
    # (not "in_place": SGLang will not flush the cache, as the last bucket asks, under running requests).
    pause_mode = "abort"
    _broken: str | None = None  # why the channel became unusable (DistributedWeightSender)

    def __init__(self, clients: list[EngineClient], engine_world_sizes: list[int], bucket_bytes: int):
        if len(clients) != len(engine_world_sizes):
            raise RlhpcError(
                f"{len(clients)} engine client(s) but {len(engine_world_sizes)} engine world size(s)",
                "pass one TP size per engine",
            )
        if not clients:
            raise RlhpcError("weight sync has no engines to send to", "start rollout engines before connecting")
        self.clients = clients
        self.engine_world_sizes = list(engine_world_sizes)
        self.bucket_bytes = int(bucket_bytes)
        self._last_answers: list[Any] = []  # every engine's answer to the latest bucket
        self._pushed = False  # a push succeeded on this channel (see send())
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(clients)), thread_name_prefix="weight-sync")

    def _on_all(self, fn: Callable[[EngineClient], Any], clients: list[EngineClient] | None = None) -> list[Any]:
        """Run fn on every engine concurrently; raise the first failure, naming the engine."""
        clients = self.clients if clients is None else clients
        if len(clients) == 1:  # no thread hop: a tiny push is a handful of round trips
            return [self._result(_done(fn, clients[0]), clients[0])]
        futures = [self._pool.submit(fn, c) for c in clients]
        return [self._result(f, c) for f, c in zip(futures, clients)]

    @staticmethod
    def _result(future: Future, client: EngineClient) -> Any:
        try:
            return future.result()
        except RlhpcError:
            raise
        except Exception as e:
            raise RlhpcError(f"engine {client.base_url}: {e}", "check the engine log") from e

    def connect(self) -> None:
        """Open the channel (no-op for channels without one)."""

    def _send_buckets(
        self, buckets: Iterator[tuple[list[tuple[str, torch.Tensor]], bool]], version: str, abort_all: bool
    ) -> int:
        """Send every bucket (the last tagged with ``version``); ``abort_all``: ask the engines to
        abort in-flight requests before the update. Returns the number of buckets."""
        raise NotImplementedError

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push HF-named tensors to every engine; afterwards all report ``weight_version == str(version)``.

        No sample mixes old and new weights: generation is paused first (SGLang's default pause
        mode aborts in-flight requests) and continued only on success. With ``pause_mode``
        "retract" (partial rollouts) the requests in flight are kept and go on with the new
        weights; the engines tag each token with the version that made it. A push of one bucket
        instead sends it with ``abort_all_requests``, which aborts in-flight requests and holds
        new ones until that one update is done (SGLang's model-update lock, the CPU engine's
        model lock): the same guarantee, two round trips fewer. SGLang refuses weight updates
        outside a weight-update session, so each push opens one per engine before its first
        bucket (every engine answering it is also the check that all are alive before any
        joins a broadcast) and closes it after the last (one session per push, not per
        bucket). After a failure the engines hold partly updated weights and
        are left paused, to be restarted; their sessions are closed where they can be. A
        channel's first push always pauses and continues, which releases the engines a failed
        push on the previous channel left paused.
        """
        v = str(version)
        self._check_ready()
        buckets = iter_buckets(named_tensors, self.bucket_bytes)
        first = next(buckets, None)
        if first is None:
            raise RlhpcError("weight sync got no tensors to send", "pass the model's named parameters")
        # abort_all_requests aborts; a channel's first push pauses and continues (releases engines a failed push left paused)
        single = first[1] and self.pause_mode == "abort" and self._pushed
        self._last_answers = []
        closed = False
        try:
            if single:
                self._on_all(self._begin_session)
            else:  # per engine: pause, then open the session (one task each, engines in parallel)
                self._on_all(lambda c: (c.pause_generation(self.pause_mode), self._begin_session(c)))
            n = self._send_buckets(itertools.chain([first], buckets), v, abort_all=single)
            closed = True  # an engine that fails its end is not asked again
            self._on_all(lambda c: c.end_weight_update())
            self._check_versions(v)
        except BaseException:
            if not closed:
                self._end_sessions_after_failure()
            if single:  # best effort: an engine that refused stays off its partly updated weights
                with contextlib.suppress(Exception):
                    self._on_all(lambda c: c.pause_generation())
            raise
        if not single:
            self._on_all(lambda c: c.continue_generation())
        self._pushed = True
        log.debug("weights version %s sent to %d engine(s) in %d bucket(s)", v, len(self.clients), n)

    def _check_ready(self) -> None:
        """Raise, before any request, when the channel cannot send."""

    def _begin_session(self, client: EngineClient) -> None:
        """Open the engine's weight-update session (SGLang refuses updates outside one)."""
        try:
            client.begin_weight_update()
        except RlhpcError as e:
            if P.SESSION_ALREADY_OPEN not in e.problem:
                raise
            # A push that failed without closing its session (an engine stuck in a broken
            # broadcast, or one that did not answer the end) left it open, and SGLang refuses a
            # second begin: close that one (it loaded nothing we still rely on) and open ours.
            log.warning("engine %s had a weight-update session left open; closing it", client.base_url)
            client.end_weight_update()
            client.begin_weight_update()

    def _end_sessions_after_failure(self) -> None:
        """Best effort: close the sessions a failed push opened, so no engine is left in one.
        Not where the channel broke mid-push: engines may sit in the dead broadcast, deaf until
        its timeout; the next push's begin closes what they keep open (``_begin_session``)."""
        if self._broken:
            return

        def end(c: EngineClient) -> None:
            with contextlib.suppress(Exception):  # none open there (refused), or the engine is gone
                c.end_weight_update(timeout_s=10)  # briefly: a dead node never answers

        with contextlib.suppress(Exception):
            self._on_all(end)

    def _check_versions(self, v: str) -> None:
        # The last bucket's answer says the version was set (SGLang and the CPU engine append
        # weight_version_note on success); ask only engines whose answer did not.
        unconfirmed = [
            c
            for c, answer in zip(self.clients, self._last_answers or [None] * len(self.clients))
            if not (isinstance(answer, dict) and weight_version_note(v) in str(answer.get("message", "")))
        ]
        versions = self._on_all(lambda c: c.get_weight_version(), unconfirmed) if unconfirmed else []
        wrong = [(c.base_url, got) for c, got in zip(unconfirmed, versions) if got != v]
        if wrong:
            raise RlhpcError(
                f"engines report the wrong weight version after sync (want {v}): {wrong}", "check the engine logs"
            )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class DistributedWeightSender(_SenderBase):
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

    def _send_buckets(
        self, buckets: Iterator[tuple[list[tuple[str, torch.Tensor]], bool]], version: str, abort_all: bool
    ) -> int:
        n = 0
        packed = self._pack(next(buckets, None), slot=0)
        while packed is not None:
            posts, bcast = self._start_bucket(packed, version, abort_all)
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

    def _pack(self, item: tuple[list[tuple[str, torch.Tensor]], bool] | None, slot: int) -> _Packed | None:
        """A bucket as one flat uint8 tensor in SGLang's flattened-bucket layout.

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
        return _Packed(flat, names, [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors], last)

    def _start_bucket(self, packed: _Packed, version: str, abort_all: bool) -> tuple[list[Future], Future]:
        """Announce the bucket to every engine (one POST each) and broadcast it (one broadcast)."""
        announce = P.UpdateWeightsFromDistributedReqInput(
            names=packed.names,
            dtypes=packed.dtypes,
            shapes=packed.shapes,
            group_name=self.group_name,
            flush_cache=packed.last,
            abort_all_requests=abort_all,
            weight_version=version if packed.last else None,
            load_format=FLATTENED_BUCKET,
        )
        posts = [self._pool.submit(c.update_weights_from_distributed, announce) for c in self.clients]
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


class TensorWeightSender(_SenderBase):
    """Colocated engines (same node): each bucket as one flat tensor passed by handle (shared
    memory on CPU, CUDA IPC on a GPU), no bytes over HTTP; each engine copies it once.

    A bucket already lying flat in one storage (``flatten_parameters``; on CPU also in shared
    memory, ``share_memory_by_name``) goes as it is. Any other is packed: on CPU into a
    shared-memory segment kept between pushes (the engines map it once); on a GPU into one
    device buffer per push, given back after it (an offloaded actor leaves the GPU to the
    engines between pushes)."""

    def __init__(self, clients: list[EngineClient], engine_world_sizes: list[int], bucket_bytes: int):
        super().__init__(clients, engine_world_sizes, bucket_bytes)
        self._staging = SharedStaging()

    def _send_buckets(
        self, buckets: Iterator[tuple[list[tuple[str, torch.Tensor]], bool]], version: str, abort_all: bool
    ) -> int:
        n = 0
        device_buf: torch.Tensor | None = None  # a GPU bucket's packing buffer, for this push
        for bucket, last in buckets:
            names, tensors = in_flat_order(bucket)
            if sendable_as_is(tensors):
                flat = adjacent_bytes(tensors)
            elif tensors[0].device.type == "cpu":
                flat = self._staging.pack(tensors)
            else:
                total = sum(nbytes(t) for t in tensors)
                if device_buf is None or device_buf.numel() < total:
                    device_buf = None  # back to the allocator before a bigger one
                    device_buf = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
                flat = flatten_into(tensors, device_buf)
            payload = serialize_flat_bucket(flat, names, tensors, receivers=sum(self.engine_world_sizes))
            posts = [
                self._pool.submit(
                    c.update_weights_from_tensor,
                    P.UpdateWeightsFromTensorReqInput(
                        serialized_named_tensors=[payload] * tp,  # SGLang wants one entry per TP rank
                        load_format=FLATTENED_BUCKET,
                        flush_cache=last,
                        abort_all_requests=abort_all,
                        weight_version=version if last else None,
                    ),
                )
                for c, tp in zip(self.clients, self.engine_world_sizes)
            ]
            # every engine has copied the bucket out once it answered: the buffer may be packed again
            self._last_answers = [self._result(f, c) for f, c in zip(posts, self.clients)]
            n += 1
        if device_buf is not None:
            del device_buf, flat
            torch.cuda.ipc_collect()  # free it once the engines have closed their handles
        return n

    def close(self) -> None:
        self._staging.close()
        super().close()


def make_weight_sender(
    clients: list[EngineClient],
    engine_world_sizes: list[int],
    colocate: bool,
    master_address: str,
    backend: str,
    bucket_bytes: int,
    pause_mode: str = "abort",
) -> DistributedWeightSender | TensorWeightSender:
    """The channel placement calls for: shared memory when colocated, a broadcast group otherwise.
    ``pause_mode``: how generation pauses for a push (``_SenderBase.pause_mode``)."""
    sender: DistributedWeightSender | TensorWeightSender
    if colocate:
        sender = TensorWeightSender(clients, engine_world_sizes, bucket_bytes)
    else:
        sender = DistributedWeightSender(clients, engine_world_sizes, master_address, backend, bucket_bytes)
    sender.pause_mode = pause_mode
    return sender
