"""A black-box agent (``rollout.agent: examples.calculator_agent:solve``): plain OpenAI-client
code with a calculator tool, pointed at the per-episode endpoint rlhpc serves.

Nothing in it knows about rlhpc: it is the loop any tool-using harness runs. Each reply that
calls the calculator gets the tool's answer and another turn (at most ``MAX_CALLS``); the first
reply without calls is the answer. It returns None, so ``data.reward`` scores the final
transcript's last reply; return a float to score the episode yourself.
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI

MAX_CALLS = 3
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of numbers, + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def calculator(expression: str) -> str:
    if set(expression) - set("0123456789+-*/(). ") or "**" in expression:  # no names, no 9**9**9
        return f"error: not arithmetic: {expression!r}"
    try:
        return str(eval(expression, {"__builtins__": {}}))
    except (SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


async def solve(row: dict, base_url: str, api_key: str) -> float | None:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    # row.messages: the file's chat (verl's prompt column), or a text prompt as one user message
    messages: list[dict] = list(row.messages)
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # sent back as it came: the calls merge
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                answer = calculator(**json.loads(call.function.arguments))
            except (TypeError, ValueError) as e:  # the model's arguments
                answer = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    await client.close()
    return None
