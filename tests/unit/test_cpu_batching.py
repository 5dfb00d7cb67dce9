"""The CPU engine's batcher: /generate requests that wait together run as one batch (as SGLang's
scheduler batches them), each answered with its own rows; a deterministic engine runs each alone."""

from __future__ import annotations

import asyncio

import pytest

from rlhpc.engine_server.cpu.batching import Batcher


class Runs:
    """A generation thread that records each batch (its rows' prompts and seq) and answers each
    row with its prompt."""

    def __init__(self, fail_on: int | None = None):
        self.batches: list[tuple[list[int], int]] = []
        self.fail_on = fail_on

    async def __call__(self, items: list, seq: int) -> list[dict]:
        self.batches.append(([it for it in items], seq))
        await asyncio.sleep(0.01)  # the batch computes; requests arriving meanwhile wait for the next
        if self.fail_on in items:
            raise RuntimeError(f"row {self.fail_on} broke the batch")
        return [{"row": it} for it in items]


def send(batcher: Batcher, requests: list[list[int]], seqs: list[int] | None = None) -> list:
    async def main() -> list:
        calls = [batcher.generate(rows, s) for rows, s in zip(requests, seqs or range(len(requests)))]
        return await asyncio.gather(*calls, return_exceptions=True)

    return asyncio.run(main())


def test_requests_waiting_together_run_as_one_batch_each_answered_with_its_rows():
    runs = Runs()
    answers = send(Batcher(runs, merge=True), [[1], [2, 3], [4]], seqs=[7, 5, 9])
    assert answers == [[{"row": 1}], [{"row": 2}, {"row": 3}], [{"row": 4}]]
    assert runs.batches == [([1, 2, 3, 4], 9)]  # an abort_all aborts the batch when it covers all of it


def test_a_batch_takes_at_most_max_rows_in_arrival_order():
    runs = Runs()
    answers = send(Batcher(runs, merge=True, max_rows=3), [[1], [2, 3], [4], [5, 6, 7, 8]])
    assert [rows for rows, _ in runs.batches] == [[1, 2, 3], [4], [5, 6, 7, 8]]  # a request is never split
    assert answers[3] == [{"row": r} for r in (5, 6, 7, 8)]


def test_a_failed_batch_fails_each_of_its_requests_and_the_next_batch_runs():
    runs = Runs(fail_on=2)
    batcher = Batcher(runs, merge=True, max_rows=2)
    answers = send(batcher, [[1], [2], [3]])
    assert [type(a) for a in answers[:2]] == [RuntimeError, RuntimeError] and answers[2] == [{"row": 3}]
    assert batcher.batches == 2 and not batcher.waiting


def test_a_deterministic_engine_runs_each_request_alone():
    runs = Runs()
    answers = send(Batcher(runs, merge=False), [[1], [2, 3], [4]])
    assert answers == [[{"row": 1}], [{"row": 2}, {"row": 3}], [{"row": 4}]]
    assert sorted(rows for rows, _ in runs.batches) == [[1], [2, 3], [4]]


def test_a_request_arriving_while_a_batch_runs_joins_the_next():
    runs = Runs()
    batcher = Batcher(runs, merge=True)

    async def main() -> list:
        first = asyncio.ensure_future(batcher.generate([1], 0))
        await asyncio.sleep(0.008)  # the first batch is running
        later = [batcher.generate([r], r) for r in (2, 3)]
        return await asyncio.gather(first, *later)

    assert asyncio.run(main()) == [[{"row": 1}], [{"row": 2}], [{"row": 3}]]
    assert [rows for rows, _ in runs.batches] == [[1], [2, 3]]


pytestmark = pytest.mark.timeout(30)
