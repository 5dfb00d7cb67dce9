"""pass@k and maj@n against values computed by hand."""

from itertools import combinations

from rlhpc.algo.pass_at_k import ks, pass_at_k, pass_metrics


def test_the_unbiased_estimator_by_hand():
    assert pass_at_k(4, 1, 2) == 1 - 3 / 6  # C(3,2) / C(4,2)
    assert pass_at_k(4, 2, 2) == 1 - 1 / 6
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0 and pass_at_k(5, 2, 1) == 2 / 5
    # it is the share of k-subsets of the n samples that hold a pass
    passes = [1, 0, 0, 1, 0, 0]
    for k in range(1, 7):
        subsets = list(combinations(passes, k))
        assert abs(pass_at_k(6, 2, k) - sum(any(s) for s in subsets) / len(subsets)) < 1e-12


def test_metrics_over_prompts_and_the_majority_answer():
    assert ks(1) == [1] and ks(4) == [1, 2, 4] and ks(6) == [1, 2, 4, 6]
    rewards = [1.0, 0.0, 0.0, 0.0] + [0.0, 1.0, 1.0, 0.0]
    responses = ["7", "8", "8", "9"] + ["3 ", "4", "4", "3"]
    got = pass_metrics(rewards, responses, 4)
    assert got["pass@1"] == (1 / 4 + 2 / 4) / 2
    assert got["pass@2"] == ((1 - 3 / 6) + (1 - 1 / 6)) / 2
    assert got["pass@4"] == 1.0
    # prompt 0: "8" is the majority, wrong; prompt 1: "3" and "4" tie, the earliest ("3 ") wins, wrong
    assert got["maj@4"] == 0.0
    assert pass_metrics([1.0, 0.0, 1.0], ["a", "b", "a"], 3)["maj@3"] == 1.0
    assert pass_metrics([0.5, 1.0], ["a", "b"], 1, threshold=0.5) == {"pass@1": 1.0}
