"""The built-in rewards on the answer forms users' data has: boxed, LaTeX, fractions, decimals."""

import threading

from rlhpc import rewards
from rlhpc.data.tasks import resolve_reward


def test_math_grades_a_marked_answer_as_mathematics():
    right = [
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5"),
        ("\\boxed{3/4}", "\\frac{3}{4}"),
        ("$\\boxed{\\sqrt{2}}$", "\\sqrt{2}"),
        ("Total: \\boxed{1,000}", "1000"),
        ("first \\boxed{5}, no: \\boxed{\\frac{6}{2}}", "3"),  # the last boxed answer counts
    ]
    wrong = [("\\boxed{7}", "8"), ("", "3"), ("no number here", "3"), ("\\boxed{\\frac{1}{3}}", "0.5")]
    assert [rewards.math("", r, a) for r, a in right] == [1.0] * len(right)
    assert [rewards.math("", r, a) for r, a in wrong] == [0.0] * len(wrong)
    # an unmarked number is no answer: noise from an untrained model that ends in the label scored
    # 1.0 when math took the last number anywhere (issue 42)
    noise = ["so x = 18.", "s0 h3 8", "so she has 18 left.\n#### 18", "\\boxed{18"]
    assert [rewards.math("", r, "18" if "18" in r else "8") for r in noise] == [0.0] * 4
    # the old behaviour, by its own name: math-verify's pick of a final answer anywhere
    assert [rewards.math_lenient("", r, "18" if "18" in r else "8") for r in noise[:3]] == [1.0] * 3
    assert rewards.math_lenient("", "\\boxed{\\frac{1}{2}}", "0.5") == 1.0


def test_gsm8k_wants_its_own_answer_form():
    right = [("so she has 18 left.\n#### 18", "18"), ("#### 1,000", "1000"), ("####-3", "-3"), ("#### $5.", "5"),
             ("#### 4 then #### 18", "18"), ("#### 18.0", "18")]  # fmt: skip
    wrong = [
        ("the answer is 18", "18"),
        ("\\boxed{18}", "18"),
        ("#### 17", "18"),
        ("#### 18 then #### 4", "18"),
        ("", "18"),
    ]
    assert [rewards.gsm8k("", r, a) for r, a in right] == [1.0] * len(right)
    assert [rewards.gsm8k("", r, a) for r, a in wrong] == [0.0] * len(wrong)


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
    assert resolve_reward("rlhpc.rewards:gsm8k") is rewards.gsm8k
    assert resolve_reward("rlhpc.rewards:math_lenient") is rewards.math_lenient
