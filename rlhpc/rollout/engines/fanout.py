"""Request fan-out: send a batch of requests over the engines (or the router) at once, and send
again what failed on an engine found dead or lost, once it is restarted or to the others.

Restarts wait for a safe moment (see ``rlhpc.rollout.engines``): in a thread inside
``restarts_deferred`` an engine found dead is only marked down and its requests go to the
healthy engines; elsewhere it is restarted (and reported, ``restarted``, to whoever keeps the
weights: the trained pool's engines are re-synced there before they serve again) and they go to it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlhpc.config import generate_timeout_s
from rlhpc.rollout.engines import health as _health
from rlhpc.wire.client import EngineClient, EngineUnavailable
from rlhpc.wire.request import GenerationAborted, StopCheck

if TYPE_CHECKING:
    from rlhpc.config import RolloutConfig
    from rlhpc.rollout.engines.engine_set import EngineSet
    from rlhpc.rollout.engines.health import Health

log = logging.getLogger(__name__)

Call = Callable[[EngineClient, Any], Any]


SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # what SGLang generates when a request names no max_new_tokens


def generate(client: EngineClient, r: Any, rollout: RolloutConfig) -> Any:
    """The default request: a /generate of a ``rlhpc.wire.request.Request``, given as long as its
    longest sample may take (``rollout.generate_timeout_s``)."""
    longest = max((sp.get("max_new_tokens") or SGLANG_DEFAULT_MAX_NEW_TOKENS for sp in r.sampling_params), default=0)
    extra = {"image_data": r.image_data} if getattr(r, "image_data", None) else {}  # a vision-language model's
    if getattr(r, "return_routed_experts", False):
        extra["return_routed_experts"] = True
    return client.generate(
        input_ids=r.input_ids, sampling_params=r.sampling_params, return_logprob=r.return_logprob,
        timeout_s=generate_timeout_s(rollout, longest), **extra,
    )  # fmt: skip


@dataclass
class _Round:
    """One round of a send: the requests sent to ``targets``, and those that failed."""

    targets: list[EngineClient]
    lost_before: int
    failed: list[int] = field(default_factory=list)
    error: EngineUnavailable | None = None


class FanOut:
    """Send requests over ``health``'s targets; ``stop`` (polled as answers come in) aborts them.
    ``restarted``: told when engines were restarted (or came back, or were lost), before they
    serve again: the trained pool's weight owner re-syncs them (None: frozen engines serve the
    model on disk)."""

    def __init__(self, engines: EngineSet, health: Health, stop: StopCheck | None = None):
        self.engines, self.health, self.stop = engines, health, stop
        self.restarted: Callable[[], None] | None = None
        self.threads = ThreadPoolExecutor(max_workers=max(4, 2 * len(engines.clients)))
        self._deferred = threading.local()

    @contextmanager
    def restarts_deferred(self) -> Iterator[None]:
        """In this thread, engines found dead are marked down, not restarted."""
        self._deferred.on = True
        try:
            yield
        finally:
            self._deferred.on = False

    def deferring(self) -> bool:
        return getattr(self._deferred, "on", False)

    def repair(self) -> list[int]:
        """Restart the dead engines (and the router) and bring them to the current weights."""
        dead = self.health.restart_dead()
        if (dead or self.health.changed) and self.restarted is not None:
            self.restarted()
        return dead

    def send(self, requests: Sequence[Any], done: Callable[[int, Any], None] | None = None,
             call: Call | None = None, first: int = 0) -> list[Any]:  # fmt: skip
        """Send request c to engine ``first`` + c (or its ``affinity``) mod the engine count (or to
        the router), all at once; the answers in request order. Requests that failed on an engine
        found dead are sent again once it is back on the current weights, or (``restarts_deferred``)
        to the healthy engines (an episode's turns then keep to the engine its affinity picks among
        those left); ``done(c, answer)`` runs as request c succeeds, once. ``call(client, request)``:
        what a request is (default: ``generate``; the reward engines' scoring passes its own).
        ``first``: where request 0 goes (a caller sending one request at a time rotates it)."""
        answers: list[Any] = [[] for _ in requests]
        pending = list(range(len(requests)))
        while pending:
            sent = _Round(self.health.targets(), len(self.health.lost))
            self._round(sent, requests, pending, answers, done, call or self._generate, first)
            if sent.failed:
                self._after_failures(sent)
            pending = sorted(sent.failed)
        return answers

    def _generate(self, client: EngineClient, r: Any) -> Any:
        return generate(client, r, self.engines.rollout_cfg)

    def _round(self, sent: _Round, requests: Sequence[Any], pending: list[int], answers: list[Any],
               done: Callable[[int, Any], None] | None, call: Call, first: int) -> None:  # fmt: skip
        """Send ``pending`` to ``sent.targets`` and wait for every answer, or for its engine's loss."""

        def target(c: int) -> EngineClient:
            affinity = getattr(requests[c], "affinity", None)  # an episode's turns: one engine while it lives
            return sent.targets[(first + c if affinity is None else affinity) % len(sent.targets)]

        futures = {self.threads.submit(lambda c: call(target(c), requests[c]), c): c for c in pending}
        waiting, checked = set(futures), time.monotonic()
        silent = _health.Silence(time.monotonic())
        while waiting:
            finished, waiting = wait(waiting, timeout=_health.NODE_CHECK_S, return_when=FIRST_COMPLETED)
            if finished:
                silent.answered()
            elif silent.due():  # an engine stopped (SIGSTOP), hung or swapping answers nothing, says nothing
                self.health.name_the_silent(silent, [target(futures[f]) for f in waiting])
            for fut in finished:
                if self.stop is not None and self.stop.requested:
                    self._abort(futures)
                c = futures[fut]
                try:
                    answers[c] = fut.result()
                except EngineUnavailable as e:  # maybe a dead engine: decided once all have answered
                    sent.failed.append(c)
                    sent.error = e
                    continue
                except BaseException:  # a bad request (RequestRefused: refused again if sent again) or a
                    for f in waiting:  # bug: the send ends, and what has not gone out yet stays here
                        f.cancel()
                    raise
                if done is not None:
                    done(c, answers[c])
            if not waiting or time.monotonic() - checked < _health.NODE_CHECK_S:
                continue
            checked = time.monotonic()
            if self.health.check_nodes():  # their requests will never be answered
                gone_clients = {id(self.engines.clients[e]) for e in self.health.lost}
                # which engine serves a request is the router's secret: all it has in flight go again
                gone_clients |= {id(c) for c in sent.targets if c.router}
                gone = {f for f in waiting if id(target(futures[f])) in gone_clients}
                sent.failed += [futures[f] for f in gone]
                waiting -= gone
                self._abandon_threads()

    def _after_failures(self, sent: _Round) -> None:
        """Requests failed: mark down or restart the engines that died, or raise the error when
        none did. Nothing is in flight now, so re-syncing (which pauses every engine) loses nothing."""
        h = self.health
        h.check_nodes()
        if self.deferring():
            # every engine and the router answer, none was lost with its node, and none was
            # restarted (a partial-rollout push restarts dead ones beside generation) since
            # these were sent: a real error
            marked = h.mark_down()
            if not marked and len(h.lost) == sent.lost_before and sent.targets == h.targets():
                raise sent.error
            where = "the healthy engine(s)"
        else:
            router = self.engines.router_client
            dead = h.restart_dead()  # may find more engines gone with their node
            if not dead and len(h.lost) == sent.lost_before and self.engines.router_client is router:
                raise sent.error  # nothing was down: a real error
            if dead and self.restarted is not None:
                self.restarted()
            where = "the restarted engine(s)" if dead else "the remaining engine(s)"
        log.warning("sending %d generation request(s) again to %s", len(sent.failed), where)

    def _abort(self, futures: dict[Future, int]) -> None:
        """Cut generation short: the engines drop what is in flight, pending requests are dropped."""
        for fut in futures:
            fut.cancel()
        for client in self.engines.clients:
            try:
                client.abort_request(abort_all=True)
            except Exception as e:  # an engine already gone has nothing to abort
                log.debug("abort on %s: %s", client.base_url, e)
        raise GenerationAborted()

    def _abandon_threads(self) -> None:
        """Requests to a node that lost power hang until their HTTP timeout: leave their threads
        behind in the old pool and send from a new one."""
        old = self.threads
        self.threads = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.engines.clients)))
        old.shutdown(wait=False)

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
