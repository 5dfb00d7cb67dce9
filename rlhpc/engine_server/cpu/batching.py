"""/generate requests that wait together run as one batch, as SGLang's scheduler batches the
requests that arrive together: through sglang_router every prompt is a request of its own
(``rlhpc.wire.protocol.per_prompt``), and one sampling batch per prompt would make the CPU
engine's generation many times slower (measured: tools/bench/router.py).

A deterministic engine (SGLang's ``--enable-deterministic-inference``, whose kernels are batch
invariant) runs each request as a batch of its own instead: a padded batch changes a row's
logprobs in their last bits, so which requests share a batch, a matter of timing, must not
decide them.

Requests are taken in arrival order, up to ``MAX_MERGED_ROWS`` rows a batch. Every row of a
batch ends together, so an ``abort_all`` aborts a batch when it covers all of its requests: a
request sent after it is never cut by it (one sent before may then run to its end).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from rlhpc.engine_server.cpu.requests import Item

# Rows of one merged batch: what rlhpc sends one engine in one request without the router
# (rlhpc.rollout.sampler.MAX_SAMPLES_PER_REQUEST)
MAX_MERGED_ROWS = 256
# How long a batch waits for the requests arriving with its first one (a rollout's prompts come
# one request each, through the router, within milliseconds): a batch of one, then one of the
# rest, would cost a whole generation more
GATHER_S = 0.005

Run = Callable[[list[Item], int], Awaitable[list[dict[str, Any]]]]


class Batcher:
    """``generate(items, seq)``: a request's rows, answered when the batch it joined has run.
    ``run(items, seq)``: runs one batch (on the engine's generation thread); ``merge``: whether
    requests waiting together share a batch."""

    def __init__(self, run: Run, merge: bool, max_rows: int = MAX_MERGED_ROWS):
        self.run, self.merge, self.max_rows = run, merge, max_rows
        self.waiting: list[tuple[list[Item], int, asyncio.Future]] = []
        self.batches = 0  # run so far (what tests look at)
        self._draining = False

    async def generate(self, items: list[Item], seq: int) -> list[dict[str, Any]]:
        if not self.merge:
            self.batches += 1
            return await self.run(items, seq)
        answer = asyncio.get_running_loop().create_future()
        self.waiting.append((items, seq, answer))
        if not self._draining:
            self._draining = True
            asyncio.ensure_future(self._drain())
        return await answer

    def _take(self) -> list[tuple[list[Item], int, asyncio.Future]]:
        """The requests of the next batch: the first waiting, and those after it that fit."""
        taken = [self.waiting.pop(0)]
        rows = len(taken[0][0])
        while self.waiting and rows + len(self.waiting[0][0]) <= self.max_rows:
            rows += len(self.waiting[0][0])
            taken.append(self.waiting.pop(0))
        return taken

    async def _drain(self) -> None:
        try:
            while self.waiting:
                await asyncio.sleep(GATHER_S)  # requests arriving together join this batch
                batch = [b for b in self._take() if not b[2].done()]  # a client gone meanwhile
                if not batch:
                    continue
                self.batches += 1
                try:
                    outs = await self.run(
                        [it for items, _, _ in batch for it in items], max(seq for _, seq, _ in batch)
                    )
                except Exception as e:  # every request of the batch gets the error
                    for _, _, answer in batch:
                        if not answer.done():
                            answer.set_exception(e)
                    continue
                start = 0
                for items, _, answer in batch:
                    if not answer.done():
                        answer.set_result(outs[start : start + len(items)])
                    start += len(items)
        finally:
            self._draining = False
