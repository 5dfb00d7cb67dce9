"""The teacher (issue 30): a frozen model whose logprobs of the trained tokens the loss reads.

Its engines are an ``EnginePool`` over ``layout.teacher_slots`` (``frozen``, role ``teacher``).
A sample is scored as SGLang scores a prompt: one ``/generate`` of prompt + response with no new
token (``max_new_tokens`` 0), ``return_logprob`` and ``logprob_start_len``; the answer's
``meta_info.input_token_logprobs`` holds each token's logprob under the teacher. SGLang answers
None for the token at ``logprob_start_len`` itself, so the request starts one token before the
response and that entry is dropped. The loss (``rlhpc.actor.rank``) uses them for on-policy
distillation (``algo.distill_coef``) or a KL penalty to the teacher (``algo.kl_target``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhpc.config import RolloutConfig, SGLangConfig, TeacherConfig
from rlhpc.errors import RlhpcError
from rlhpc.wire.client import EngineClient
from rlhpc.wire.protocol import MetaInfo

if TYPE_CHECKING:
    from rlhpc.cluster.layout import Layout
    from rlhpc.cluster.placement import Placement
    from rlhpc.config import ClusterConfig
    from rlhpc.rollout.engines import EnginePool
    from rlhpc.wire.request import StopCheck


def teacher_rollout_config(rollout: RolloutConfig, t: TeacherConfig) -> RolloutConfig:
    """The engine settings of the teacher pool: the rollout's lifecycle limits, the teacher's
    backend and SGLang options, no router."""
    return dataclasses.replace(
        rollout,
        backend=t.backend,
        sglang=SGLangConfig(mem_fraction_static=t.mem_fraction_static, router=False, extra_args=list(t.extra_args)),
    )


def start_teacher_engines(
    t: TeacherConfig,
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
    """The teacher engines on ``layout.teacher_slots``, up and answering /health."""
    from rlhpc.rollout.engines import EnginePool  # Ray and torch: the job's, not a dry run's

    return EnginePool.start(
        teacher_rollout_config(rollout, t), cluster, seed, model_path, placement, layout, log_dir, stop,
        frozen=True, role="teacher", deterministic=deterministic,
    )  # fmt: skip


def check_same_vocabulary(policy_tokenizer: Any, teacher_tokenizer: Any, teacher_path: str) -> None:
    """The teacher scores the policy's token ids: both tokenizers must map ids to the same tokens."""
    if policy_tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
        raise RlhpcError(
            f"the teacher at {teacher_path} has another tokenizer than the policy: its logprobs would be of other tokens",
            "use a teacher of the policy's family (the same tokenizer), or for teacher.tiny the policy's "
            "tokenizer and seed (model.tiny.tokenizer, model.tiny.seed)",
        )


def request(prompt: list[int], response: list[int]) -> tuple[list[int], int]:
    """One sample's input and ``logprob_start_len``: from the prompt's last token, whose own
    logprob SGLang answers as None, so every response token gets its logprob."""
    return prompt + response, len(prompt) - 1


def response_logprobs(answer: dict, num_tokens: int) -> list[float]:
    """The last ``num_tokens`` entries of an answer's ``input_token_logprobs``: the response's."""
    entries = answer["meta_info"][MetaInfo.INPUT_TOKEN_LOGPROBS]
    if len(entries) < num_tokens + 1:
        raise RlhpcError(
            f"a teacher engine answered {len(entries)} input logprobs for a response of {num_tokens} tokens",
            "serve the teacher with an SGLang that answers logprob_start_len (or the CPU engine)",
        )
    return [float(e[0]) for e in entries[len(entries) - num_tokens :]]


class Teacher:
    """``logprobs(prompts, responses)``: each response token's logprob under the teacher."""

    def __init__(self, engines: EnginePool, batch_size: int):
        self.engines, self.batch_size = engines, batch_size

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        if not prompts:
            return []
        pairs = [request(p, r) for p, r in zip(prompts, responses)]
        size = self.batch_size
        batches = [pairs[i : i + size] for i in range(0, len(pairs), size)]

        def call(client: EngineClient, batch: list[tuple[list[int], int]]) -> list[dict]:
            out = client.generate(
                input_ids=[ids for ids, _ in batch],
                sampling_params=[{"max_new_tokens": 0} for _ in batch],
                return_logprob=True,
                logprob_start_len=[start for _, start in batch],
            )
            return out if isinstance(out, list) else [out]

        answers = [a for answer in self.engines.send(batches, call=call) for a in answer]
        return [response_logprobs(a, len(r)) for a, r in zip(answers, responses)]
