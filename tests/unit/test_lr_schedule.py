"""The learning rate of each optimizer step, against values worked out by hand."""

import math

import pytest

from rlhpc.actor.lr_schedule import lr_at
from rlhpc.actor.spec import ActorSpec
from rlhpc.config import Config, ConfigError
from rlhpc.preflight import load_config


def rates(schedule: str, warmup: int, decay: int, steps: int, lr: float = 1.0, min_lr: float = 0.1) -> list[float]:
    return [lr_at(s, lr, schedule, warmup, decay, min_lr) for s in range(steps)]


def test_constant_is_the_old_behaviour_and_warms_up_linearly():
    assert rates("constant", 0, 10, 3) == [1.0, 1.0, 1.0]
    # warmup of 4: (s + 1) / 4, so the first step already moves; then the full rate
    assert rates("constant", 4, 10, 6) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_linear_decay_by_hand():
    # warmup 2, decay to 0.1 at step 6: p = (s - 2) / 4 -> 1 - 0.9 p
    assert rates("linear", 2, 6, 8) == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1])


def test_cosine_decay_by_hand():
    # no warmup, decay over 4 steps: 0.1 + 0.9 (1 + cos(pi s / 4)) / 2
    half = 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2  # 0.86820...
    quarter = 0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2  # 0.23180...
    assert rates("cosine", 0, 4, 6) == pytest.approx([1.0, half, 0.55, quarter, 0.1, 0.1])


def test_decay_ends_at_the_runs_last_step_by_default():
    cfg = load_config(None, ["model.tiny={}", "rollout.num_rollout=5", "actor.num_steps_per_rollout=3"])
    assert ActorSpec.from_config(cfg).lr_decay_steps == 15
    assert ActorSpec.from_config(cfg, num_rollout=7).lr_decay_steps == 21  # the driver's count wins
    cfg.actor.lr_decay_steps = 4
    assert ActorSpec.from_config(cfg, num_rollout=7).lr_decay_steps == 4


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_at(0, 1.0, "step", 0, 10, 0.0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["actor.lr_schedule=exp"], "actor.lr_schedule = 'exp' is not one of 'constant' | 'linear' | 'cosine'"),
        (["actor.lr_warmup_steps=-1"], "actor.lr_warmup_steps = -1 must be >= 0"),
        (["actor.min_lr=-1e-6"], "actor.min_lr = -1e-06 must be >= 0"),
        (["actor.lr=1e-4", "actor.min_lr=1e-3"], "actor.min_lr = 0.001 is above actor.lr = 0.0001"),
        (["actor.lr_decay_steps=0"], "actor.lr_decay_steps = 0 must be >= 1"),
        (["actor.lr_warmup_steps=10", "actor.lr_decay_steps=10"], "actor.lr_decay_steps = 10 is not after the warmup"),
    ],
)
def test_bad_schedules_are_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.tiny={}", *overrides])
    assert message in str(e.value) and e.value.fix


def test_defaults_keep_a_constant_rate():
    a = Config().actor
    assert (a.lr_schedule, a.lr_warmup_steps, a.lr_decay_steps, a.min_lr) == ("constant", 0, None, 0.0)
