"""A generate function (``rollout.generate_fn: examples.self_check:self_check``): answer, then
be asked to check the answer and answer again; ``data.reward`` scores the second answer.

It shows the whole contract: the prompt is rendered with the tokenizer's chat template, the
engine's tokens are kept as they came (loss mask 1, with the engine's logprobs), and the tokens
between the two replies come from the same template (``Conversation.extend``: what the chat
renders with the new message, minus what it rendered before), loss mask 0.
"""

from __future__ import annotations

from rlhpc.rollout.episodes import Conversation
from rlhpc.rollout.trajectories import Trajectory

CHECK = {"role": "user", "content": "Check your answer, then give only the final answer."}


async def self_check(row: dict, engine) -> Trajectory:
    tok = engine.tokenizer
    # row.messages: the file's chat (verl's prompt column), or a text prompt as one user message
    chat = Conversation(tok, tok.chat_template, "of the tokenizer", row.messages)
    first = await engine.generate(chat.prompt_ids)
    between = chat.extend(first.tokens, first.text, [CHECK])
    second = await engine.generate(chat.prompt_ids + first.tokens + between)
    return Trajectory(
        prompt_ids=chat.prompt_ids,
        response_ids=first.tokens + between + second.tokens,
        loss_mask=[1] * len(first.tokens) + [0] * len(between) + [1] * len(second.tokens),
        logprobs=first.logprobs + [0.0] * len(between) + second.logprobs,
        reward=None,  # data.reward (here the task's own) scores the last reply
    )
