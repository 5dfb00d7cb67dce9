"""What an execution's outcome means (the code's, or the node's), and the tests a code row holds,
read without running anything."""

from __future__ import annotations

import signal

import pytest

from rlhpc.config import SandboxConfig
from rlhpc.errors import ConfigError
from rlhpc.sandbox.pool import classify
from rlhpc.sandbox.testing import extract_code, parse_tests

CFG = SandboxConfig(wall_s=10.0, cpu_s=4.0, overload_share=0.5)


def answer(**kw):
    base = {"timed_out": False, "exit_code": 0, "signal": None, "cpu_s": 0.1, "child_cpu_s": 0.1, "waited_s": 0.0}
    return {**base, **kw}


@pytest.mark.parametrize(
    ("kw", "status"),
    [
        ({}, "ok"),
        ({"exit_code": 1}, "error"),
        ({"timed_out": True, "cpu_s": 0.0, "waited_s": 0.1}, "timeout"),  # asleep or blocked: its own
        ({"timed_out": True, "cpu_s": 9.5, "waited_s": 0.3}, "timeout"),  # had the CPU it asked for
        ({"timed_out": True, "cpu_s": 6.0, "waited_s": 60.0}, "timeout"),  # its own processes crowd each other
        ({"timed_out": True, "cpu_s": 1.0, "waited_s": 8.5}, "overloaded"),  # wanted the CPU and did not get it
        ({"exit_code": None, "signal": int(signal.SIGXCPU), "child_cpu_s": 4.0}, "cpu_limit"),
        ({"exit_code": None, "signal": int(signal.SIGKILL), "child_cpu_s": 4.99}, "cpu_limit"),
        ({"exit_code": None, "signal": int(signal.SIGKILL), "child_cpu_s": 0.2}, "killed"),
        ({"exit_code": None, "signal": int(signal.SIGSEGV)}, "crashed"),
        ({"exit_code": None, "signal": int(signal.SIGXFSZ)}, "crashed"),
    ],
)
def test_an_outcome_is_the_codes_or_the_nodes(kw, status):
    assert classify(answer(**kw), CFG)[0] == status


def test_a_worker_fault_is_infrastructure():
    assert classify({"worker_error": "OSError: boom"}, CFG)[0] == "lost"


def test_the_forms_of_a_rows_tests():
    io = parse_tests('{"inputs": ["1 2\\n"], "outputs": ["3\\n"]}')
    assert io.kind == "stdio" and io.inputs == ["1 2\n"] and len(io) == 1
    call = parse_tests('{"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"}')
    assert call.kind == "call" and call.fn_name == "add"
    assert parse_tests('["assert f(1) == 2", "assert f(2) == 3"]').asserts == ["assert f(1) == 2", "assert f(2) == 3"]
    assert parse_tests('{"assert_case": ["assert f(1) == 2"]}').asserts == ["assert f(1) == 2"]
    assert parse_tests("def check(f):\n    assert f(1) == 2\ncheck(f)").kind == "asserts"
    assert parse_tests('"[\\"assert g() == 1\\"]"').asserts == ["assert g() == 1"]  # a JSON text of the tests
    for bad in ('{"inputs": [1], "outputs": []}', '{"x": 1}', "", '{"inputs": [1], "outputs": [1], "fn_name": "a b"}'):
        with pytest.raises(ValueError):
            parse_tests(bad)


def test_the_solution_is_the_last_code_block():
    assert extract_code("look:\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```\n") == "x = 2\n"
    assert extract_code("print(3)") == "print(3)"


def test_the_sandbox_section_refuses_what_cannot_run():
    with pytest.raises(ConfigError, match="sandbox.image"):
        SandboxConfig(backend="apptainer")
    with pytest.raises(ConfigError, match="sandbox.binds"):
        SandboxConfig(binds=["relative/path"])
    with pytest.raises(ConfigError, match="overload_share"):
        SandboxConfig(overload_share=1.5)
