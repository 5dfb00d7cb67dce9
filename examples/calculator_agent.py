"""A black-box agent (``rollout.agent: examples.calculator_agent:solve``): plain OpenAI-client
code with a calculator tool, pointed at the per-episode endpoint rlhpc serves.

Nothing in it knows about rlhpc: it is the loop any tool-using harness runs. Each reply that
calls the calculator gets the tool's answer and another turn (at most ``MAX_CALLS``); the first
reply without calls is the answer. It returns None, so ``data.reward`` scores the final
transcript's last reply; return a float to score the episode yourself.
"""

from __future__ import annotations

import ast
import json
import operator

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


MAX_EXPRESSION = 200  # characters: a calculator's input, not a program
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """The tool: any input is an answer, an error the model reads included, never an exception
    (one would end the episode, and the run with it). Bounded: 3,000 characters of nested
    parentheses or signs once raised MemoryError or RecursionError in Python's own parser."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION:
        return f"error: not an expression of at most {MAX_EXPRESSION} characters"
    if set(expression) - set("0123456789+-*/(). "):  # no names, no calls
        return f"error: not arithmetic: {expression!r}"
    try:
        return str(_value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ArithmeticError, RecursionError, MemoryError) as e:
        return f"error: {type(e).__name__}: {e}"


def _value(node: ast.expr) -> int | float:
    """Numbers, + - * / and parentheses only (no ``**``: 9**9**9 has 370 million digits)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


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
