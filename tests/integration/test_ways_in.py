"""The three ways into multi-turn rollouts besides an environment, each as a whole local job
through real engine servers (HTTP, the pool's routing): an OpenAI-client agent
(``rollout.agent``, examples/calculator_agent.yaml), a generate function (``rollout.generate_fn``,
examples/self_check.yaml) and tools (``rollout.tools`` without an environment). Checked from
what the job wrote: each sample's tokens under loss mask 1 are the policy's own sampling, their
logprobs what transformers gives the initial weights for the first rollout, and the tokens
between the replies (mask 0) are the template's and the tools'."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
from support.jobs import REPO, rollouts, said, submit
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhpc.metrics import read_metrics

ONE_ROLLOUT = ("rollout.num_rollout=1", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2")
EXAMPLES_ON_PATH = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def samples(run: Path) -> list[tuple[list[int], list[int], list[int], list[float]]]:
    """Rollout 0's (prompt ids, response ids, loss mask, logprobs) per sample, from its dump."""
    with h5py.File(run / "rollouts" / "rollout_000000.h5") as f:
        cols = [f[k][:] for k in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs")]
    return [tuple(x.tolist() for x in row) for row in zip(*cols)]


def mask_runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each maximal run of ``mask``."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def assert_the_policys_own_tokens(run: Path) -> list[tuple]:
    """Every token under loss mask 1 has the logprob the initial policy gives it after what
    precedes it (transformers' log-softmax): the engines' sampling, recorded as it came."""
    model = AutoModelForCausalLM.from_pretrained(run / "base_model", dtype=torch.float32).eval()
    rows = samples(run)
    assert rows
    with torch.no_grad():
        for prompt, response, mask, logprobs in rows:
            assert len(response) == len(mask) == len(logprobs) and 1 in mask
            lp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0], -1)
            for i, (token, m, got) in enumerate(zip(response, mask, logprobs)):
                if m:
                    assert got == pytest.approx(lp[len(prompt) - 1 + i, token].item(), abs=1e-4), (i, token)
                else:
                    assert got == 0.0
    return rows


def submit_config(run: Path, config: str, *overrides: str):
    """jobs/submit.py --config CONFIG: the example as a user runs it, cut to one small rollout."""
    cmd = [sys.executable, str(REPO / "jobs" / "submit.py"), "--cluster", "local", "--run-dir", str(run)]
    cmd += ["--config", str(REPO / config)]
    for o in (*ONE_ROLLOUT, "data.num_train=16", *overrides):
        cmd += ["--set", o]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, **EXAMPLES_ON_PATH}
    )


def test_an_agent_job_trains_each_episodes_calls_as_one_sample(tmp_path):
    """examples/calculator_agent.yaml, every reply read as a calculator call: each episode is the
    agent's three calls through the endpoint, sent back as they came, so one sample: three
    replies (mask 1) with the template's closing and the tool's answer between them (mask 0)."""
    run = tmp_path / "run"
    p = submit_config(
        run, "examples/calculator_agent.yaml", "rollout.tool_parser=support.tool_parsers:calls_the_calculator"
    )
    assert p.returncode == 0, said(p)[-4000:]
    assert rollouts(run) == [0]
    tok = AutoTokenizer.from_pretrained(run / "base_model")
    for _prompt, response, mask, _ in assert_the_policys_own_tokens(run):
        runs = mask_runs(mask)
        assert [v for v, _, _ in runs] == [1, 0, 1, 0, 1], runs
        for _, start, end in runs[1::2]:  # between two replies: the calculator's answer to 1+2, as a tool turn
            assert "<|im_start|>tool\n3<|im_end|>" in tok.decode(response[start:end])
    (record,) = [m for m in read_metrics(run) if m["kind"] == "rollout"]
    assert record["samples"] == 4  # one per episode


def test_a_generate_function_job_trains_both_replies(tmp_path):
    """examples/self_check.yaml: two replies, the check request between them (mask 0)."""
    run = tmp_path / "run"
    p = submit_config(run, "examples/self_check.yaml")
    assert p.returncode == 0, said(p)[-4000:]
    assert rollouts(run) == [0]
    tok = AutoTokenizer.from_pretrained(run / "base_model")
    for _prompt, response, mask, _ in assert_the_policys_own_tokens(run):
        runs = mask_runs(mask)
        assert [v for v, _, _ in runs] == [1, 0, 1], runs
        assert "Check your answer, then give only the final answer." in tok.decode(response[runs[1][1] : runs[1][2]])


def test_a_tools_job_answers_the_calls_and_ends_at_a_reply_without_one(tmp_path):
    """rollout.tools without an environment: a reply that calls add gets its answer (mask 0) and
    another turn; the first reply without a call ends the episode, which data.reward scores."""
    run = tmp_path / "run"
    p = submit(
        run, "model.tiny.tokenizer=bpe", "model.tiny.max_position_embeddings=512", "data.task=digit_sum",
        *ONE_ROLLOUT, "rollout.tools=[support.tool_parsers:add]", "rollout.tool_parser=support.tool_parsers:sometimes_adds",
        "rollout.max_turns=3", "rollout.max_new_tokens=4", "rollout.max_episode_tokens=200", "eval.interval=null",
        "checkpoint.save_interval=null",
    )  # fmt: skip
    assert p.returncode == 0, said(p)[-4000:]
    assert rollouts(run) == [0]
    tok = AutoTokenizer.from_pretrained(run / "base_model")
    turns = []
    for _prompt, response, mask, _ in assert_the_policys_own_tokens(run):
        runs = mask_runs(mask)
        replies = [response[s:e] for v, s, e in runs if v == 1]
        between = [tok.decode(response[s:e]) for v, s, e in runs if v == 0]
        assert all("<|im_start|>tool\n5<|im_end|>" in b for b in between), between
        # every reply but the last called add; the last did not, or the episode ran out of turns
        assert all(sum(map(ord, tok.decode(r))) % 2 == 0 for r in replies[:-1])
        turns.append(len(replies))
    assert max(turns) > 1  # some episode called a tool
