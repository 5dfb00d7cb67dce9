"""The classifier reward model (issue 30): frozen engines of their own, and how a sample is scored.

The engines are an ``EnginePool`` over ``layout.reward_slots`` (``frozen``: no weight channel, so
a restarted engine serves the model on disk as the others do), each serving a
``*ForSequenceClassification`` model through SGLang's ``/classify`` (SGLang: ``--is-embedding``;
the CPU engine server: the same route). A sample is the conversation ``prompt`` + ``response``
rendered with the reward model's own chat template when its tokenizer has one (else the plain
text, tokenized with the tokenizer's special tokens), tokenized here (``data.prompts.render_chat``:
control tokens the policy writes as text stay text), so the engine scores
exactly the ids a test can give ``transformers``; the score is the model's first label at the
last token.

A rollout's (or an evaluation's) samples are scored as their /generate request is answered
(``reward_model.overlap``, the default; else once the generation is done), one /classify batch per
request (split at ``reward_model.batch_size``), spread over the engines (``scoring.GroupScores``);
a multi-turn episode's after its generation, in batches of ``reward_model.batch_size``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhpc.config import RewardModelConfig, RolloutConfig, SGLangConfig
from rlhpc.data.prompts import encode_untrusted, render_chat
from rlhpc.rollout.scoring import Sample
from rlhpc.schedule import BusyClock
from rlhpc.wire.client import EngineClient

if TYPE_CHECKING:
    from rlhpc.cluster.layout import Layout
    from rlhpc.cluster.placement import Placement
    from rlhpc.config import ClusterConfig
    from rlhpc.rollout.engines import EnginePool
    from rlhpc.wire.request import StopCheck

log = logging.getLogger(__name__)

# SGLang serves a model as an embedding model (answering /classify) with this flag; it infers it
# for the classifiers it knows, the flag makes it so for any architecture.
EMBEDDING_FLAG = "--is-embedding"


def reward_rollout_config(rollout: RolloutConfig, rm: RewardModelConfig) -> RolloutConfig:
    """The engine settings of the reward pool: the rollout's lifecycle limits (start-up timeout,
    restarts), the reward model's backend and SGLang options, no router; a classifier is served as
    an embedding model, a judge as the chat model it is."""
    extra = list(rm.extra_args)
    if rm.kind == "classifier" and EMBEDDING_FLAG not in extra:
        extra.insert(0, EMBEDDING_FLAG)
    return dataclasses.replace(
        rollout,
        backend=rm.backend,
        sglang=SGLangConfig(mem_fraction_static=rm.mem_fraction_static, router=False, extra_args=extra),
    )


def start_reward_engines(
    rm: RewardModelConfig,
    rollout: RolloutConfig,
    cluster: ClusterConfig,
    seed: int,
    model_path: str,
    placement: Placement,
    layout: Layout,
    log_dir: Path,
    stop: StopCheck | None = None,
    deterministic: bool = False,
) -> EnginePool:
    """The reward engines on ``layout.reward_slots``, up and answering /health (``deterministic``:
    a judge's seeded samples are the same on rerun)."""
    from rlhpc.rollout.engines import EnginePool  # Ray and torch: the job's, not a dry run's

    return EnginePool.start(
        reward_rollout_config(rollout, rm), cluster, seed, model_path, placement, layout, log_dir, stop, frozen=True,
        deterministic=deterministic,
    )  # fmt: skip


def render(tokenizer: Any, sample: Sample) -> list[int]:
    """The token ids the reward model scores for ``sample``: the conversation (a chat prompt's
    messages, else the prompt as the user's turn, then the response as the assistant's) through
    the reward model's chat template, or, without one, the prompt text + the response."""
    if getattr(tokenizer, "chat_template", None):
        messages = (
            [dict(m) for m in sample.messages] if sample.messages else [{"role": "user", "content": sample.prompt}]
        )
        messages.append({"role": "assistant", "content": sample.response})
        # the one rendering path: a response that writes the template's control tokens as text
        # gets them as text, so it cannot forge a turn in what the reward model reads
        return render_chat(tokenizer, tokenizer.get_chat_template(), messages, add_generation_prompt=False)[1]
    return encode_untrusted(tokenizer, sample.prompt, sample.response)


class RewardModel:
    """Score samples with the reward engines: ``score(samples)`` is one float per sample,
    ``score_groups(groups)`` one list per group. ``clock``: when the reward group worked (the
    step's ``time/reward_idle``)."""

    def __init__(self, engines: EnginePool, tokenizer: Any, batch_size: int, context_len: int | None = None):
        self.engines, self.tokenizer, self.batch_size = engines, tokenizer, batch_size
        self.clock = BusyClock()
        self.sent = 0  # batches sent so far: the next call starts at the engine after the last one
        # an input must be shorter than the context (the engines refuse the rest): keep its end,
        # where the response and the token the score is read at are
        self.max_len = context_len - 1 if context_len else None
        self.truncated = 0

    def inputs(self, samples: list[Sample]) -> list[list[int]]:
        out = []
        for s in samples:
            ids = render(self.tokenizer, s)
            if self.max_len is not None and len(ids) > self.max_len:
                self.truncated += 1
                ids = ids[-self.max_len :]
            out.append(ids)
        return out

    def score(self, samples: list[Sample]) -> list[float]:
        return [s for group in self.score_groups([samples]) for s in group]

    def score_groups(self, groups: Sequence[Sequence[Sample]]) -> list[list[float]]:
        """Each group in batches of its own (at most ``batch_size``), all sent at once."""
        spans, batches = [], []
        for group in groups:
            ids = self.inputs(list(group))
            first = len(batches)
            batches += [ids[i : i + self.batch_size] for i in range(0, len(ids), self.batch_size)]
            spans.append(range(first, len(batches)))
        if not batches:
            return [[] for _ in groups]
        first, self.sent = self.sent, self.sent + len(batches)
        with self.clock.busy():
            answers = self.engines.send(
                batches, call=lambda client, batch: EngineClient.classify(client, batch), first=first
            )
        return [[score for b in span for score in answers[b]] for span in spans]
