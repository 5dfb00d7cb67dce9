"""The generative judge (issue 30, ``reward_model.kind: judge``): a frozen chat model asked for a verdict.

``judge_prompt(sample) -> messages`` writes the question, the judge's chat template renders it
(with the generation prompt), the frozen reward engines answer it on ``/generate`` (the path
rollouts take, with ``reward_model.sampling`` and a seed of each sample's own), and
``judge_parse(text) -> float`` reads the score from the answer. The built-in pair below asks for
a number from 0 to 10 and reads it back as a fraction of 10.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlhpc.config import RewardModelConfig
from rlhpc.data.prompts import encode_untrusted, render_chat
from rlhpc.errors import RlhpcError
from rlhpc.rollout.scoring import Sample
from rlhpc.util.imports import import_function
from rlhpc.wire.request import Request, knob_params, sample_seed

if TYPE_CHECKING:  # not at run time: the preflight imports this module, and ray must wait for its auth
    from rlhpc.rollout.engines import EnginePool

PROMPT_SIGNATURE = "judge_prompt(sample: rlhpc.rollout.scoring.Sample) -> list of {'role', 'content'} messages"
PARSE_SIGNATURE = "judge_parse(text: str) -> float"

JudgePrompt = Callable[[Sample], list[dict]]
JudgeParse = Callable[[str], float]


# ------------------------------------------------------------------ the built-in judge

MAX_SCORE = 10


def score_prompt(sample: Sample) -> list[dict]:
    """One user turn: the task, the response, then the ask (last, so a long response cut from the
    left to fit the judge's context keeps it)."""
    return [
        {
            "role": "user",
            "content": (
                f"Here is a task and a response to it.\n\nTask:\n{sample.prompt}\n\nResponse:\n{sample.response}\n\n"
                f"Rate the response from 0 (wrong or useless) to {MAX_SCORE} (correct and complete). "
                "Answer with the number only."
            ),
        }
    ]


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_score(text: str) -> float:
    """The last number of the answer, held to [0, 10], divided by 10; 0 when there is none (a
    judge that does not answer in the format asked gives no credit)."""
    found = _NUMBER.findall(text)
    if not found:
        return 0.0
    return min(max(float(found[-1]), 0.0), MAX_SCORE) / MAX_SCORE


# ------------------------------------------------------------------ scoring


def resolve_judge(rm: RewardModelConfig) -> tuple[JudgePrompt, JudgeParse]:
    """The two user functions, imported (each failure names its key and the fix)."""
    prompt = import_function("reward_model.judge_prompt", rm.prompt_spec, PROMPT_SIGNATURE)
    parse = import_function("reward_model.judge_parse", rm.parse_spec, PARSE_SIGNATURE)
    return prompt, parse


def render(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The judge's input ids: its chat template with the generation prompt, or (a tokenizer
    without one) the messages' contents one after the other, with the tokenizer's special tokens;
    control tokens in the messages' text (the policy's response) stay text."""
    if getattr(tokenizer, "chat_template", None):
        # the one rendering path: the response inside the question cannot forge the judge's turns
        return render_chat(tokenizer, tokenizer.get_chat_template(), messages, add_generation_prompt=True)[1]
    return encode_untrusted(tokenizer, "", "\n\n".join(str(m["content"]) for m in messages))


class Judge:
    """Score samples with the judge engines: ``score(samples)`` is one float per sample."""

    def __init__(
        self, engines: EnginePool, tokenizer: Any, rm: RewardModelConfig, seed: int, context_len: int | None = None
    ):
        self.engines, self.tokenizer, self.rm, self.seed = engines, tokenizer, rm, seed
        self.prompt_fn, self.parse_fn = resolve_judge(rm)
        s = rm.sampling
        self.params = {
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            **knob_params(s.top_k, s.min_p, s.repetition_penalty, s.stop),
        }
        # the question and the answer fit the judge's context: a longer question keeps its end
        self.max_len = context_len - s.max_new_tokens if context_len else None
        if self.max_len is not None and self.max_len < 1:
            raise RlhpcError(
                f"reward_model.sampling.max_new_tokens = {s.max_new_tokens} leaves no room in the judge's "
                f"context of {context_len} tokens",
                "lower reward_model.sampling.max_new_tokens",
            )
        self.truncated = 0

    def requests(self, samples: list[Sample]) -> list[Request]:
        ids, params = [], []
        for s in samples:
            messages = self.prompt_fn(s)
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
                raise RlhpcError(
                    f"reward_model.judge_prompt {self.rm.prompt_spec} returned {str(messages)[:200]}",
                    "return a list of chat messages, e.g. [{'role': 'user', 'content': '...'}]",
                )
            x = render(self.tokenizer, messages)
            if self.max_len is not None and len(x) > self.max_len:
                self.truncated += 1
                x = x[-self.max_len :]
            ids.append(x)
            # the judgement's seed is the question's own: a rerun (or a resend) judges alike
            params.append({**self.params, "sampling_seed": sample_seed(self.seed, "judge", *x)})
        size = self.rm.batch_size
        return [
            Request(input_ids=ids[i : i + size], sampling_params=params[i : i + size], return_logprob=False)
            for i in range(0, len(ids), size)
        ]

    def score(self, samples: list[Sample]) -> list[float]:
        if not samples:
            return []
        answers = self.engines.send(self.requests(samples))
        texts = [a["text"] for answer in answers for a in answer]
        scores = []
        for s, text in zip(samples, texts):
            try:
                scores.append(float(self.parse_fn(text)))
            except Exception as e:
                raise RlhpcError(
                    f"reward_model.judge_parse {self.rm.parse_spec} raised {type(e).__name__}: {e} on the judge's "
                    f"answer {text[:120]!r} (to the response {s.response[:80]!r})",
                    "make judge_parse return a score for every answer, e.g. 0.0 for one without a verdict",
                ) from e
        return scores
