"""One name per metric everywhere (issue 42, item 7): metrics.jsonl, the console, wandb, the plots
and docs/reference/metrics.md, which is generated from rlhpc/metric_names.py. An undocumented
metric a job logs fails the tests (tests/conftest.py checks every module's run dirs) and is
warned of in the job's log."""

from __future__ import annotations

import json
import logging

from rlhpc.cli import metrics_reference
from rlhpc.config import AlgoConfig, DynamicSamplingConfig, EvalConfig, EvalSetConfig, LoggingConfig, RolloutConfig
from rlhpc.data.rows import as_row
from rlhpc.metric_names import METRICS, eval_name, find, undocumented
from rlhpc.metrics import MetricsLogger, _console_line, read_metrics
from rlhpc.rollout.generation import Generation
from rlhpc.run_dir import RunDir


def test_the_reference_is_generated_from_the_list_and_every_entry_says_what_it_means():
    assert metrics_reference.OUT.read_text() == metrics_reference.render(), "run python -m rlhpc.cli.metrics_reference"
    assert metrics_reference.main(["--check"]) == 0
    assert len({(m.kind, m.name) for m in METRICS}) == len(METRICS)
    assert all(len(m.meaning) > 10 for m in METRICS)
    for name in ("grad_norm", "optimizer_steps", "time/wait_rollout", "episode/turns", "distill/kl", "eval/gsm8k/mean"):
        assert f"`{name}`" in metrics_reference.OUT.read_text() or find("eval", name) is not None


def test_names_are_matched_by_their_patterns_and_an_unknown_one_is_found():
    assert find("rollout", "reward/my_part") and find("rollout", "moe_load_balancing_loss")
    assert find("eval", "eval/gsm8k/pass@8") and find("eval", "eval/maj@4") and find("eval", "eval/hard/reward/format")
    assert find("eval", "gsm8k/mean") is None and find("rollout", "eval/reward") is None  # each kind its own names
    record = {"kind": "rollout", "rollout_id": 3, "reward": 0.5, "loss": 0.1, "my_new_metric": 1.0}
    assert undocumented(record) == ["my_new_metric"]


class Lengths:
    """A ``send``: each sample answers ``n`` tokens (one of ``lengths`` in turn), "length" at max_new_tokens."""

    def __init__(self, lengths):
        self.lengths, self.k = lengths, 0

    def __call__(self, requests, done):
        answers = []
        for c, r in enumerate(requests):
            out = []
            for p in r.sampling_params:
                n = self.lengths[self.k % len(self.lengths)]
                self.k += 1
                reason = {"type": "length", "length": n} if n == p["max_new_tokens"] else {"type": "stop", "matched": 2}
                meta = {"finish_reason": reason, "output_token_logprobs": [[-0.5, 7, None]] * n}
                out.append({"output_ids": [7] * n, "text": "x" * n, "meta_info": meta})
            answers.append(out)
            done(c, out)
        return answers


def test_what_generation_logs_is_documented():
    """The rollout and eval metrics of single-turn generation with a dict reward, dynamic sampling
    and the overlong knobs (the job-level ones: every integration run, by tests/conftest.py)."""
    rows = [as_row({"prompt": f"p{i}", "answer": "a"}).derive(prompt_ids=[1, 2]) for i in range(4)]

    def reward(prompt, response, answer):
        return {"score": float(len(response) % 2), "format": 1.0}

    rollout = RolloutConfig(
        n_samples_per_prompt=2, max_new_tokens=4, overlong_filter=True,
        dynamic_sampling=DynamicSamplingConfig(filter="nonzero_std", max_rounds=2),
    )  # fmt: skip
    gen = Generation(None, reward, rollout, EvalConfig(), AlgoConfig(overlong_buffer=2), 0, Lengths([1, 4, 2, 3]))
    _, metrics, _ = gen.rollout(0, rows[:2], lambda round, count: (rows * count)[:count])
    assert {"dynamic_sampling/kept", "overlong/filtered", "overlong/penalty", "reward/format"} <= set(metrics)
    assert undocumented({"kind": "rollout", **metrics}) == []
    s = EvalSetConfig(None, "prompt", "answer", 4, 1.0, 4, -1, 0.0, 1.0, [])
    for name in (None, "gsm8k"):
        values = {eval_name(name, k): v for k, v in gen.evaluate(0, rows, s, "eval").items()}
        assert {eval_name(name, "pass@4"), eval_name(name, "maj@4"), eval_name(name, "reward/format")} <= set(values)
        assert undocumented({"kind": "eval", **values}) == []


def test_the_console_shows_each_eval_set_and_names_rollouts_by_their_id():
    named = {"eval/gsm8k/mean": 0.5, "eval/gsm8k/pass@1": 0.5, "eval/hard/mean": 0.25, "eval/hard/response_len": 9.0}
    assert _console_line("eval", 3, 4, named) == "eval after rollout 3 | gsm8k 0.500 hard 0.250"
    assert _console_line("eval", -1, 4, {"eval/reward": 0.1, "eval/response_len": 2.0}) == (
        "eval before rollout 0 | reward 0.100 len 2.0"
    )
    # the last of 4 rollouts is rollout 3, as its checkpoint rollout_000003 and metrics.jsonl name it
    assert _console_line("rollout", 3, 4, {"reward": 0.5}).startswith("rollout 3 (4/4) | reward 0.500")


def test_the_file_holds_the_names_the_reference_gives_and_warns_of_an_unknown_one(tmp_path, caplog):
    run = RunDir(tmp_path)
    logger = MetricsLogger(run, LoggingConfig(wandb_mode="disabled", dump_rollouts=False), {}, 4, None)
    with caplog.at_level(logging.WARNING, logger="rlhpc.metrics"):
        logger.log("eval", -1, {"eval/gsm8k/mean": 0.5})
        logger.log("rollout", 0, {"reward": 0.5, "not_a_metric": 1.0})
        logger.log("rollout", 1, {"reward": 0.5, "not_a_metric": 1.0})
    logger.close()
    assert [r for r in caplog.messages if "not_a_metric" in r] == [
        "metric not_a_metric is not in rlhpc/metric_names.py: this is a bug of rlhpc, report it"
    ]  # once
    first = json.loads(run.metrics_file.read_text().splitlines()[0])
    assert first == {"kind": "eval", "rollout_id": -1, "eval/gsm8k/mean": 0.5}
    assert read_metrics(run)[0] == first
    run.metrics_file.unlink()  # else tests/conftest.py fails this module for not_a_metric, as it should
