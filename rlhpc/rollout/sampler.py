"""The sampler interface: rows in, ``n`` scored samples per row out (``Samples``).

Three samplers implement it, each in its own module: ``plain`` (one /generate call per sample),
``environment`` (``rollout.env`` / ``rollout.tools``: episodes run turn by turn in lockstep) and
``custom`` (``rollout.generate_fn`` / ``rollout.agent``: every sample from the user's code).
``rlhpc.rollout.generation.Generation`` picks one and turns its samples into a rollout or an
evaluation. A request's rows depend only on the row index and every sample has its own seed, so a
rerun, or a request sent again after an engine restart, gets the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rlhpc.rollout.scoring import MixedScorer, Scorer
from rlhpc.wire.request import Send

if TYPE_CHECKING:
    from rich.progress import Progress

    from rlhpc.data.rows import Row
    from rlhpc.rollout.samples import Samples

# At most this many samples per /generate request: a request is one engine batch on the CPU
# engine (SGLang batches across requests anyway), and a bar step.
MAX_SAMPLES_PER_REQUEST = 256


def rows_per_request(num_rows: int, n: int, num_engines: int) -> int:
    """Rows per /generate request: the batch spread evenly over the engines, in requests of at
    most MAX_SAMPLES_PER_REQUEST samples (at least one row). ``num_engines`` is the configured
    count, not the live one, so a run sends the same requests whatever engines it loses."""
    per_engine = -(-num_rows // max(1, num_engines))
    return max(1, min(per_engine, MAX_SAMPLES_PER_REQUEST // n))


@dataclass
class Sampling:
    """What every sampler samples and scores with."""

    tokenizer: Any
    reward_fn: Scorer | MixedScorer
    seed: int
    send: Send
    num_engines: int  # configured, not live: the requests do not depend on the engines lost
    top_p: float
    progress: Progress | None = None

    @contextmanager
    def bar(self, desc: str, total: int) -> Iterator[Callable[[int], None]]:
        """A progress bar of ``total`` steps while the block runs (none without ``progress``);
        yields the function that advances it."""
        progress = self.progress
        if progress is None:
            yield lambda steps: None
            return
        task = progress.add_task(desc, total=total)
        try:
            yield lambda steps: progress.advance(task, steps)
        finally:
            progress.remove_task(task)


@dataclass(frozen=True)
class Draw:
    """What one sampler call is asked: ``n`` responses per row. ``params``: further sampling
    params of every request (``knob_params``); ``journal_scope``: the tool journal's file of this
    generation (``rlhpc.rollout.journal.scope_name``); ``seed_tag``: the tag of every sample's
    seed; ``desc``: the progress bar's label."""

    rows: list[Row]
    n: int
    temperature: float
    max_new_tokens: int
    seed_tag: object
    desc: str
    params: dict[str, Any]
    journal_scope: str | None = None


class Sampler(Protocol):
    """Samples the draw's responses and scores them."""

    def sample(self, draw: Draw) -> Samples: ...
