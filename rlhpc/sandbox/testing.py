"""A solution run against its row's tests in the sandbox: what ``rlhpc.rewards:code`` and the
``code`` task score with.

The tests are the row's label (``data.label_key``; verl's code datasets keep them at
``reward_model.ground_truth``), in one of the forms code datasets use:

- ``{"inputs": [...], "outputs": [...]}`` (APPS, CodeContests, TACO as verl's ``prime_code``
  reads them): standard input and the expected standard output, one execution per test; the
  outputs are compared line by line, trailing whitespace ignored;
- the same with ``"fn_name"``: each input is the list of arguments of a call of that function,
  its JSON result compared with the output;
- asserts: a JSON list of Python statements (MBPP's ``test_list``), an object with one under
  ``assert_case``, ``asserts``, ``test_list`` or ``test``, or plain Python test code (HumanEval's
  ``check(...)``). The solution then the statements run in one execution, each counted apart.

An assert passes only if its statement ran to its end: the count is printed after a marker
drawn fresh for every execution, after the last statement, so a solution that exits early (
``os._exit(0)``) passes nothing. A stdin/stdout test is compared outside the sandbox, where the
code cannot reach. (Code that reads the test harness's memory or the marker's place in its own
source could still forge an assert's count; compare outputs where that matters.)
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from rlhpc.errors import InfrastructureFailure
from rlhpc.sandbox.pool import Job, Result, SandboxPool

_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S | re.I)
_ASSERT_KEYS = ("assert_case", "asserts", "test_list", "test")


@dataclass(frozen=True)
class Tests:
    kind: Literal["stdio", "call", "asserts"]
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    fn_name: str | None = None
    asserts: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.asserts) if self.kind == "asserts" else len(self.inputs)


FORMS = (
    'tests as {"inputs": [...], "outputs": [...]} (stdin/stdout; with "fn_name" calls of that function), a JSON '
    'list of assert statements, {"assert_case": [...]}, or plain Python test code'
)


def parse_tests(label: str) -> Tests:
    """The row's tests from its label (module doc); ValueError naming the forms if it is none."""
    text = label.strip()
    try:
        data = json.loads(text)
    except ValueError:
        if not text:
            raise ValueError(f"the label is empty, not {FORMS}") from None
        return Tests("asserts", asserts=[text])  # Python test code as it is
    if isinstance(data, str):
        return parse_tests(data)  # a JSON string holding the tests (verl's files often do)
    if isinstance(data, list) and data and all(isinstance(a, str) for a in data):
        return Tests("asserts", asserts=list(data))
    if isinstance(data, dict):
        if "inputs" in data and "outputs" in data:
            inputs, outputs = list(data["inputs"]), list(data["outputs"])
            if len(inputs) != len(outputs) or not inputs:
                raise ValueError(f"the label has {len(inputs)} inputs and {len(outputs)} outputs; {FORMS}")
            fn = data.get("fn_name")
            if fn is not None and not (isinstance(fn, str) and fn.isidentifier()):
                raise ValueError(f"the label's fn_name {fn!r} is not a Python name")
            return Tests("call" if fn else "stdio", inputs, outputs, fn)
        for key in _ASSERT_KEYS:
            if key in data:
                return parse_tests(json.dumps(data[key]))
    raise ValueError(f"the label {text[:120]!r} holds no tests: want {FORMS}")


def extract_code(response: str) -> str:
    """The solution in a response: its last fenced code block (```python ... ```), else all of it."""
    blocks = _BLOCK.findall(response)
    return blocks[-1] if blocks else response


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


@dataclass(frozen=True)
class Verdict:
    passed: int
    total: int
    results: tuple[Result, ...]

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


class _Plan:
    """The executions judging one solution, and how to count their outcomes."""

    def __init__(self, program: str, tests: Tests):
        self.tests, self.marker = tests, f"rlhpc-{secrets.token_hex(8)}"
        if tests.kind == "asserts":
            # Each statement compiled and run apart, after the solution, counted only if it ends.
            lines = [program, "", "_rlhpc_n = 0"]
            for statement in tests.asserts:
                lines += [
                    "try:",
                    f"    exec(compile({statement!r}, 'tests.py', 'exec'), globals())",
                    "    _rlhpc_n += 1",
                ]
                lines += ["except BaseException:", "    pass"]
            lines.append(f"print({self.marker!r}, _rlhpc_n)")
            self.jobs = [Job("\n".join(lines))]
        elif tests.kind == "stdio":
            self.jobs = [Job(program, stdin=_text(i)) for i in tests.inputs]
        else:
            call = (
                "\nimport json as _rlhpc_json, sys as _rlhpc_sys\n"
                f"_rlhpc_out = {tests.fn_name}(*_rlhpc_json.loads(_rlhpc_sys.stdin.read()))\n"
                f"print({self.marker!r} + _rlhpc_json.dumps(_rlhpc_out))\n"
            )
            self.jobs = [Job(program + "\n" + call, stdin=json.dumps(_args(i))) for i in tests.inputs]

    def verdict(self, results: Sequence[Result]) -> Verdict:
        if any(r.infra for r in results):  # a test whose outcome is unknown leaves the whole sample unscored
            raise next(r for r in results if r.infra).failure()
        t = self.tests
        if t.kind == "asserts":
            found = [line.split() for line in results[0].stdout.splitlines() if line.startswith(self.marker + " ")]
            passed = int(found[-1][1]) if found and results[0].ok else 0
        elif t.kind == "stdio":
            passed = sum(r.ok and _lines(r.stdout) == _lines(_text(o)) for r, o in zip(results, t.outputs))
        else:
            passed = sum(r.ok and _same(_returned(r.stdout, self.marker), o) for r, o in zip(results, t.outputs))
        return Verdict(passed, len(t), tuple(results))


def _text(x: object) -> str:
    return x if isinstance(x, str) else "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _args(x: object) -> list:
    """A call's arguments: a list as they are (APPS/TACO), a JSON text of one, or one argument."""
    if isinstance(x, str):
        try:
            x = json.loads(x)
        except ValueError:
            return [x]
    return x if isinstance(x, list) else [x]


def _same(returned: object, expected: object) -> bool:
    """A call's result against its expected output, as JSON compares them (tuples as lists);
    APPS and TACO often keep the expected value in a one-item list."""
    if isinstance(expected, str):
        try:
            expected = json.loads(expected)
        except ValueError:
            pass
    expected = json.loads(json.dumps(expected))
    return returned == expected or (isinstance(expected, list) and len(expected) == 1 and returned == expected[0])


def _returned(stdout: str, marker: str) -> object:
    for line in reversed(stdout.splitlines()):
        if line.startswith(marker):
            try:
                value = json.loads(line[len(marker) :])
            except ValueError:
                return _NOTHING
            return value
    return _NOTHING


_NOTHING = object()


def judge_all(
    pool: SandboxPool, programs: Sequence[str], tests: Sequence[Tests]
) -> list[Verdict | InfrastructureFailure]:
    """Each program against its tests, every execution of every one through the pool at once;
    a program whose executions failed for infrastructure gets its ``InfrastructureFailure``.
    A program repeated with the same tests is judged once (code whose outcome changes from one
    run to the next, by chance or the clock, gets one draw per batch)."""
    # The same program against the same tests (a group's samples once the policy agrees) is run once.
    keys = [(p, json.dumps(dataclasses.asdict(t), sort_keys=True)) for p, t in zip(programs, tests)]
    first = {key: k for k, key in reversed(list(enumerate(keys)))}
    distinct = list(dict.fromkeys(keys))
    plans = [_Plan(programs[first[key]], tests[first[key]]) for key in distinct]
    results = pool.run_all([job for plan in plans for job in plan.jobs])
    verdicts: dict = {}
    start = 0
    for key, plan in zip(distinct, plans):
        mine = results[start : start + len(plan.jobs)]
        start += len(plan.jobs)
        try:
            verdicts[key] = plan.verdict(mine)
        except InfrastructureFailure as e:
            verdicts[key] = e
    return [verdicts[key] for key in keys]
