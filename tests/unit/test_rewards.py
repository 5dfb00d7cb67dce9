"""The built-in rewards on the answer forms users' data has: boxed, LaTeX, fractions, decimals."""

import threading

from rlhpc import rewards
from rlhpc.data.tasks import resolve_reward


def test_math_grades_answers_as_mathematics():
    right = [
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5"),
        ("so x = 18.", "18"),
        ("\\boxed{3/4}", "\\frac{3}{4}"),
        ("$\\boxed{\\sqrt{2}}$", "\\sqrt{2}"),
        ("Total: \\boxed{1,000}", "1000"),
        ("so she has 18 left.\n#### 18", "18"),  # GSM8K's own answer form
    ]
    wrong = [("\\boxed{7}", "8"), ("", "3"), ("no number here", "3"), ("\\boxed{\\frac{1}{3}}", "0.5")]
    assert [rewards.math("", r, a) for r, a in right] == [1.0] * len(right)
    assert [rewards.math("", r, a) for r, a in wrong] == [0.0] * len(wrong)


def test_math_grades_off_the_main_thread_too():
    got = []
    t = threading.Thread(target=lambda: got.append(rewards.math("", "\\boxed{2}", "2")))
    t.start()
    t.join()
    assert got == [1.0]


def test_exact_and_both_by_their_config_names():
    assert rewards.exact("", " 42\n", "42") == 1.0 and rewards.exact("", "42.0", "42") == 0.0
    assert resolve_reward("rlhpc.rewards:math") is rewards.math
    assert resolve_reward("rlhpc.rewards:exact") is rewards.exact
