"""The examples of the three ways into multi-turn rollouts (examples/*.yaml) load and validate:
their environment, generate function or agent imports and has the right shape. (The agent and
generate-function examples run as whole jobs in tests/integration/test_ways_in.py.)"""

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
