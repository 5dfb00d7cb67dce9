"""What both weight channels share: buckets, the push's steps around them, and the sender base.

A push pauses generation first, opens a weight-update session on every engine
(``/begin_weight_update``: SGLang refuses updates outside one), checks each bucket for NaN and
infinities and sends it, tags the last bucket with ``flush_cache`` and the new
``weight_version``, closes the session (``/end_weight_update``), checks that every engine set
that version (its answer to the last bucket says so, as SGLang's does; else it is asked), then
continues generation. Only one trainer process (rank 0, holding full HF-named tensors) sends.
The two transports, chosen by placement (``rlhpc.weights.sender.make_weight_sender``):
``broadcast`` (disaggregated) and ``shared_memory`` (colocated).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rlhpc.errors import RlhpcError
from rlhpc.weights.tensor_transport import (
    flat_layout,
    flat_order,
    nbytes,
    non_finite,
)
from rlhpc.wire import protocol as P
from rlhpc.wire.client import EngineClient, EngineUnavailable
from rlhpc.wire.lora import not_loaded
from rlhpc.wire.protocol import weight_version_note

log = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "rlhpc_weight_sync"
# How long a push flushes the cache again after SGLang refused it because requests were still
# running (a race with the pause's aborts; slime retries too): then the push fails.
FLUSH_RETRY_S = 10.0


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


def run_now(fn: Callable[..., Any], *args: Any) -> Future:
    """fn(*args) run here, as a finished future (so errors are reported like the pool's)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as e:
        future.set_exception(e)
    return future


@dataclass
class Packed:
    """One bucket ready for the wire: its bytes and the announce's metadata, in sending order."""

    flat: torch.Tensor
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    last: bool


class SenderBase:
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
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(clients)), thread_name_prefix="weight-sync")

    def _on_all(self, fn: Callable[[EngineClient], Any], clients: list[EngineClient] | None = None) -> list[Any]:
        """Run fn on every engine concurrently; raise the first failure, naming the engine."""
        clients = self.clients if clients is None else clients
        if len(clients) == 1:  # no thread hop: a tiny push is a handful of round trips
            return [self._result(run_now(fn, clients[0]), clients[0])]
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

    def _send_buckets(self, buckets: Iterator[tuple[list[tuple[str, torch.Tensor]], bool]], version: str) -> int:
        """Check and send every bucket (``_checked``; the last tagged with ``version``). Returns
        the number of buckets."""
        raise NotImplementedError

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push HF-named tensors to every engine; afterwards all report ``weight_version == str(version)``.

        No sample mixes old and new weights: generation is paused first (SGLang's default pause
        mode aborts in-flight requests and waits until none is left) and continued only on
        success. With ``pause_mode`` "retract" (partial rollouts) the requests in flight are kept
        and go on with the new weights; the engines tag each token with the version that made it.
        Every push pauses, one bucket or many: SGLang's ``/begin_weight_update`` of an engine
        that is not paused waits until every request in flight has finished, and between two
        buckets new requests would run on half-updated weights.

        SGLang refuses weight updates outside a weight-update session, so each push opens one
        per engine before its first bucket (every engine answering it is also the check that all
        are alive before any joins a broadcast) and closes it after the last (one session per
        push, not per bucket). No bucket holding NaN or an infinity is sent (``_checked``): a
        diverged trainer's weights never reach an engine. After a failure the engines hold
        partly updated weights and are left paused, to be restarted; their sessions are closed
        where they can be.
        """
        v = str(version)
        self._check_ready()
        buckets = iter_buckets(named_tensors, self.bucket_bytes)
        first = next(buckets, None)
        if first is None:
            raise RlhpcError("weight sync got no tensors to send", "pass the model's named parameters")
        self._last_answers = []
        closed = False
        try:
            # per engine: pause, then open the session (one task each, engines in parallel)
            self._on_all(lambda c: (c.pause_generation(self.pause_mode), self._begin_session(c)))
            n = self._send_buckets(itertools.chain([first], buckets), v)
            closed = True  # an engine that fails its end is not asked again
            self._on_all(lambda c: c.end_weight_update())
            self._check_versions(v)
        except BaseException:
            if not closed:
                self._end_sessions_after_failure()
            raise
        self._on_all(lambda c: c.continue_generation())
        log.debug("weights version %s sent to %d engine(s) in %d bucket(s)", v, len(self.clients), n)

    def send_adapter(self, name: str, directory: str, version: int, shared: bool = False) -> None:
        """Push a LoRA adapter (its PEFT files in ``directory``, on a file system every engine
        reads) as ``version``: each engine, paused as for a full push, drops the adapter it serves
        under ``name`` and loads this one under it, and records the version. No bucket, no
        weight-update session: the base weights do not change. After a failure the engines are
        left paused, to be restarted, as after a failed full push.

        ``shared`` (a shared fleet, serving other runs' adapters too): no pause, which would abort
        the other runs' requests (this run has none in flight: its loop is synchronous, and an
        unload waits for the requests naming the adapter), and no engine version, which is one
        per engine: the run keeps its adapter's version itself (``WeightSync``)."""
        v = str(version)

        if shared:
            self._on_all(lambda c: self._swap_adapter(c, name, directory))
            log.debug("LoRA adapter %s version %s sent to %d shared engine(s)", name, v, len(self.clients))
            return

        def swap(c: EngineClient) -> None:
            c.pause_generation(self.pause_mode)
            self._swap_adapter(c, name, directory)
            c.update_weight_version(v)

        self._last_answers = []  # no bucket answers: each engine is asked its version
        self._on_all(swap)
        self._check_versions(v)
        self._on_all(lambda c: c.continue_generation())
        log.debug("LoRA adapter version %s sent to %d engine(s)", v, len(self.clients))

    @staticmethod
    def _swap_adapter(c: EngineClient, name: str, directory: str) -> None:
        """The adapter ``name`` on engine ``c`` is now the one in ``directory``."""
        try:
            c.unload_lora_adapter(name)
        except RlhpcError as e:  # none yet: the first push, or an engine started again since
            if not_loaded(name) not in e.problem:
                raise
        c.load_lora_adapter(P.LoadLoRAAdapterReqInput(lora_name=name, lora_path=directory))

    def _checked(self, flat: torch.Tensor, names: list[str], tensors: list[torch.Tensor]) -> None:
        """Raise, before the bucket leaves, if it holds NaN or an infinity: a diverged trainer's
        weights never reach an engine, SGLang's included (it loads whatever it is sent). Here,
        where the bytes are, once for every engine: one read of the bucket (``non_finite``),
        beside the engines' load of the previous bucket when there is one."""
        dtypes = [t.dtype for t in tensors]
        bad = non_finite(flat, dtypes, flat_layout(dtypes, [list(t.shape) for t in tensors]), names)
        if bad:
            raise RlhpcError(
                f"the trainer's weights hold NaN or infinite values in {len(bad)} tensor(s): {', '.join(bad[:5])}"
                f"{' ...' if len(bad) > 5 else ''}; nothing of this bucket was sent",
                "the training diverged: lower actor.lr or set actor.grad_clip, and resume from the last checkpoint",
            )

    def _update(self, client: EngineClient, call: Callable[[Any], Any], req: Any) -> Any:
        """``call(req)``, one bucket's update on one engine. SGLang fails the update whose cache
        flush (the last bucket's) finds requests running or queued, with the weights loaded but
        the version not recorded: then flush again until the engine is idle (bounded), and set
        the version. Returns the engine's answer, or None when the version must be asked."""
        try:
            return call(req)
        except RlhpcError as e:
            if not (req.flush_cache and P.FLUSH_BUSY in e.problem):
                raise
        log.warning("engine %s was busy at the weight update's cache flush; flushing again", client.base_url)
        delay, deadline = 0.05, time.monotonic() + FLUSH_RETRY_S
        while True:
            try:
                client.flush_cache()
                break
            except EngineUnavailable:
                raise
            except RlhpcError as e:  # HTTP 400: still busy
                if time.monotonic() + delay > deadline:
                    raise RlhpcError(
                        f"engine {client.base_url}: the cache flush after a weight update still finds requests "
                        f"after {FLUSH_RETRY_S:.0f}s: {e.problem}",
                        "nothing should generate during a push: check what sends requests to the trained engines",
                    ) from e
            time.sleep(delay)
            delay = min(2 * delay, 1.0)
        if req.weight_version is not None:
            client.update_weight_version(req.weight_version)
        return None

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
