"""The examples of the three ways into multi-turn rollouts (examples/*.yaml) load and validate:
their environment, generate function or agent imports and has the right shape. (The agent
example runs rollouts in tests/integration/test_agent.py.)"""

from pathlib import Path

import pytest

from rlhpc.preflight import load_config

REPO = Path(__file__).resolve().parents[2]
WAYS_IN = {
    "echo_env.yaml": ("env", "examples.echo_env:EchoEnv"),
    "self_check.yaml": ("generate_fn", "examples.self_check:self_check"),
    "calculator_agent.yaml": ("agent", "examples.calculator_agent:solve"),
}


def test_every_example_config_is_listed():
    assert sorted(p.name for p in (REPO / "examples").glob("*.yaml")) == sorted(WAYS_IN)


@pytest.mark.parametrize("name", sorted(WAYS_IN))
def test_an_example_config_validates(name, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # as PYTHONPATH=$PWD does for the job
    cfg = load_config(REPO / "examples" / name)
    key, spec = WAYS_IN[name]
    assert getattr(cfg.rollout, key) == spec
    # the one way in: the other two keys unset
    assert [k for k in ("env", "generate_fn", "agent") if getattr(cfg.rollout, k) is not None] == [key]


@pytest.mark.parametrize(
    "expression",
    [
        "(" * 1500 + "1" + ")" * 1500,  # too many nested parentheses
        "-" * 3000 + "1",  # RecursionError in the compiler
        "+".join(["1"] * 1500),
        "9" * 1500 + "*" + "9" * 1499,
        "9**9**9",
        "(1)(1)",
        "1/0",
        "__import__('os')",
    ],
)
def test_the_shipped_calculator_answers_any_input_and_never_raises(monkeypatch, expression):
    # Issue 43, item 11: 3,000-character inputs raised MemoryError or RecursionError, which
    # ended the episode and the run: a tool's bad input is a tool result
    monkeypatch.syspath_prepend(str(REPO))
    from examples.calculator_agent import calculator

    assert calculator(expression).startswith("error: ")
    assert calculator("6*(3+4)/2") == "21.0" and calculator("-2*-3") == "6"
