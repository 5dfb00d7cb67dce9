"""The teacher (issue 30) through a whole local run, against transformers: the logprobs the loop
trains with are the teacher's log-softmax of the same tokens, and distill/kl (and the KL penalty
to the teacher) the token mean of the initial policy's logprobs minus those."""

from __future__ import annotations

import h5py
import pytest
import torch
from support.jobs import said, submit
from transformers import AutoModelForCausalLM

from rlhpc.metrics import read_metrics


def token_logprobs(path, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
    """transformers' log-softmax of each response token at the position before it."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            lp = torch.log_softmax(model(torch.tensor([p + r])).logits[0], -1)
            out.append([lp[len(p) - 1 + k, t].item() for k, t in enumerate(r)])
    return out


def test_a_local_run_distills_from_the_teachers_logprobs(tmp_path):
    """One rollout of a tiny policy with a tiny teacher of its tokenizer (other weights) on a GPU
    of its own, distilling (algo.distill_coef) with a k1 KL penalty to the teacher."""
    run = tmp_path / "run"
    p = submit(
        run, "rollout.num_rollout=1", "rollout.rollout_batch_size=4", "eval.interval=null",
        "cluster.gpus_per_node=3", "teacher.tiny.seed=7", "algo.distill_coef=0.5", "algo.kl_coef=0.1",
        "algo.kl_target=teacher", "algo.kl_estimator=k1", "actor.num_steps_per_rollout=1",
    )  # fmt: skip
    assert p.returncode == 0, said(p)[-4000:]
    assert "teacher engine 0   (tp=1) -> " in (run / "layout.txt").read_text()
    (m,) = [r for r in read_metrics(run) if r["kind"] == "rollout"]
    with h5py.File(run / "rollouts" / "rollout_000000.h5") as f:
        prompts = [x.tolist() for x in f["prompt_ids"][:]]
        responses = [x.tolist() for x in f["response_ids"][:]]
        got = [x.tolist() for x in f["teacher_logprobs"][:]]
    teacher = token_logprobs(run / "teacher", prompts, responses)
    flat = [x for row in teacher for x in row]
    assert [x for row in got for x in row] == pytest.approx(flat, abs=1e-5)
    policy = [x for row in token_logprobs(run / "base_model", prompts, responses) for x in row]
    assert max(abs(a - b) for a, b in zip(policy, flat)) > 0.1  # another model: the check below means something
    # the one step's old policy, and its current one, is the initial model (the k1 KL penalty too)
    expected = sum(a - b for a, b in zip(policy, flat)) / len(flat)
    assert m["distill/kl"] == pytest.approx(expected, abs=1e-4)
    assert m["kl"] == pytest.approx(expected, abs=1e-4)
    assert m["time/teacher"] > 0
