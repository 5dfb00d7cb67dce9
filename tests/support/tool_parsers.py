"""Tool parsers and a tool for whole jobs of the tiny random model, which writes no tool-call
markup: what reads its replies as calls (``rollout.tool_parser: support.tool_parsers:NAME``)."""

from rlhpc.wire.tool_calls import ParsedCall


def calls_the_calculator(text: str) -> list[ParsedCall]:
    """Every reply calls the calculator (examples/calculator_agent.py's tool): an agent's
    episode then runs to its last call, each tool answer sent back."""
    return [ParsedCall("calculator", '{"expression": "1+2"}')]


def sometimes_adds(text: str) -> list[ParsedCall]:
    """A reply whose characters' codes sum to an even number calls ``add``; the others answer."""
    return [ParsedCall("add", '{"a": 2, "b": 3}')] if sum(map(ord, text)) % 2 == 0 else []


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b
