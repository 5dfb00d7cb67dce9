"""Every metric rlhpc logs, by the one name it has everywhere: ``metrics.jsonl``, the console,
wandb, the plots and ``docs/reference/metrics.md`` (generated from this list by
``python -m rlhpc.cli.metrics_reference``).

A rollout record (``kind: rollout``) holds the rollout's metrics; an eval record (``kind:
eval``) holds every eval set's, each under ``eval/``: the default set's (``data.eval_file``,
the task's own eval rows) as ``eval/reward``, ``eval/pass@4``, a named set's as
``eval/NAME/mean``, ``eval/NAME/pass@4``. ``MetricsLogger`` warns of a name that is not here,
and the tests fail on one (tests/conftest.py), so a new metric comes with its description.

In a name, ``{set}`` stands for an eval set's name, ``{k}`` and ``{n}`` for numbers,
``{part}`` for a reward's own part, ``{stat}`` for a statistic's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Literal

EVAL = "eval/"  # every eval record's metric starts with this


@dataclass(frozen=True)
class Metric:
    name: str  # as logged; with placeholders (module doc)
    kind: Literal["rollout", "eval"]
    meaning: str
    see: str = ""  # the page that explains it, relative to docs/reference/

    @property
    def pattern(self) -> re.Pattern[str]:
        return _compile(self.name)


_PLACEHOLDERS = {"{set}": r"[A-Za-z0-9_.-]+", "{k}": r"\d+", "{n}": r"\d+", "{part}": r".+", "{stat}": r"[A-Za-z0-9_]+"}


@cache
def _compile(name: str) -> re.Pattern[str]:
    out = re.escape(name)
    for holder, rx in _PLACEHOLDERS.items():
        out = out.replace(re.escape(holder), rx)
    return re.compile(out)


ASYNC = "../guides/async.md"
LOSSES = "../guides/losses.md"
TASK = "../guides/your-own-task.md"
MULTI = "../guides/multi-turn.md"
EVALS = "../guides/evaluation.md"
RM = "../guides/reward-models.md"
SANDBOX = "../guides/sandbox.md"

_ROLLOUT = [
    ("reward", "the mean reward of the rollout's samples (the task's, before any overlong penalty)", TASK),
    ("reward_std", "the standard deviation of the samples' rewards", TASK),
    ("response_len", "the mean response length in tokens (an episode's: its replies and observations)", TASK),
    ("samples", "the samples trained on", ""),
    ("loss", "the loss: pg_loss + algo.kl_loss_coef x kl - algo.entropy_coef x entropy", LOSSES),
    ("pg_loss", "the policy-gradient loss (token mean over the rollout)", LOSSES),
    ("kl", "the KL estimate to the reference model (algo.kl_estimator; token mean)", LOSSES),
    ("clipfrac", "the share of tokens whose ratio was clipped", LOSSES),
    ("entropy", "the policy's entropy (token mean, before the update)", LOSSES),
    ("rollout_logprob_abs_diff", "the mean |trainer logprob - engine logprob| of the generated tokens", ASYNC),
    ("tis_clipfrac", "algo.tis: the share of tokens whose importance weight was truncated", ASYNC),
    ("tis_weight", "algo.tis: the mean importance weight", ASYNC),
    ("distill/kl", "on-policy distillation: the reverse KL to the teacher (token mean)", RM),
    ("kl/reward_penalty", "algo.kl_coef: the mean KL penalty taken off the rewards", LOSSES),
    ("grad_norm", "the gradient norm, mean over the rollout's optimizer steps (before clipping)", LOSSES),
    ("lr", "the learning rate after the rollout's steps", LOSSES),
    ("tokens", "the response tokens trained on (loss mask 1)", ""),
    ("optimizer_steps", "optimizer steps taken since the run began", ""),
    ("skipped_steps", "this rollout's optimizer steps skipped for a non-finite gradient", ""),
    ("moe_{stat}", "Qwen3-MoE on the megatron actor: the router's auxiliary losses per layer (load balancing)", ""),
    ("time/step", "one rollout's step, end to end, in seconds (the console's step)", "../architecture/map.md"),
    ("time/generate", "generating and scoring the rollout (the console's gen)", "../architecture/map.md"),
    ("time/wait_rollout", "async: the step's wait for the rollout generated ahead", ASYNC),
    ("time/train", "training on the rollout (the console's train)", "../architecture/map.md"),
    ("time/update_weights", "pushing the weights to the engines (the console's sync)", "../architecture/weight-sync.md"),
    ("time/save", "the time the loop was blocked by a save", "../architecture/checkpoints.md"),
    ("time/save_write", "the background write and commit of a save (on the rollout record where it is known)",
     "../architecture/checkpoints.md"),
    ("time/teacher", "the teacher's logprobs of the rollout", RM),
    ("time/actor_idle", "the actor's idle share of the step", ASYNC),
    ("time/rollout_idle", "the rollout engines' idle share of the step", ASYNC),
    ("time/reward_idle", "with a reward_model: the reward group's idle share of the step (no /classify in flight)", ASYNC),
    ("staleness/mean", "how many weight versions behind the samples were, mean", ASYNC),
    ("staleness/max", "how many weight versions behind the samples were, at most", ASYNC),
    ("staleness/token_mean", "the staleness per token (partial rollouts)", ASYNC),
    ("staleness/straddling", "partial rollouts: the share of samples whose tokens span a weight push", ASYNC),
    ("rollout/num_engines", "engines serving the rollout (drops when a node holding engines is lost)", "../guides/node-loss.md"),
    ("dynamic_sampling/kept", "dynamic sampling: prompt groups kept", ASYNC),
    ("dynamic_sampling/dropped", "dynamic sampling: prompt groups dropped by the filter", ASYNC),
    ("dynamic_sampling/rounds", "dynamic sampling: generation rounds", ASYNC),
    ("dynamic_sampling/short", "dynamic sampling: dropped groups used to fill the batch", ASYNC),
    ("dynamic_sampling/reward_generated", "dynamic sampling: the mean reward over every sample generated, dropped too", ASYNC),
    ("overlong/filtered", "rollout.overlong_filter: samples cut at their limit, masked out", LOSSES),
    ("overlong/penalty", "algo.overlong_buffer: the mean soft overlong penalty", LOSSES),
    ("reward/errors", "samples whose reward raised, scored 0 (data.reward_errors: zero)", TASK),
    ("infra/failed", "samples left unscored because their sandbox could not run (start failure, killed from "
     "outside, starved by the node): masked out of the loss and of their group's baseline, never scored 0", SANDBOX),
    ("reward/rule", "with a reward_model: the rule reward (data.reward) before weighting", RM),
    ("reward/reward_model", "with a reward_model: its score before weighting", RM),
    ("reward/{part}", "each other part of a reward that returns a dict (the score trains; the parts are logged)", TASK),
    ("episode/turns", "multi-turn: replies per episode, mean", MULTI),
    ("episode/truncated", "multi-turn: the share of episodes cut by max_turns or max_episode_tokens", MULTI),
    ("episode/observation_tokens", "multi-turn: observation (and template) tokens per episode, masked out, mean", MULTI),
    ("episode/tool_calls", "tools: calls per episode, mean", MULTI),
    ("episode/tool_errors", "tools: calls per episode that raised or named no tool, mean", MULTI),
    ("episode/tool_timeouts", "tools: calls per episode past rollout.tool_timeout_s, mean", MULTI),
    ("episode/samples", "a generate function or agent: samples per episode (an agent's may give several)", MULTI),
]  # fmt: skip

# What ``Generation.evaluate`` returns for one set; logged as eval/NAME (``eval_name``)
_EVAL_SET = [
    ("reward", "mean", "the mean reward over the set (an episode counts once)"),
    ("response_len", "response_len", "the mean response length in tokens"),
    ("pass@{k}", "pass@{k}", "the unbiased pass@k, k = 1, 2, 4, ... up to n_samples_per_prompt (eval.pass_threshold)"),
    ("maj@{n}", "maj@{n}", "with n = n_samples_per_prompt > 1: the share of prompts whose most common answer passes"),
    ("reward/{part}", "reward/{part}", "each part of a reward that returns a dict (reward/errors: the count)"),
    ("episode/{stat}", "episode/{stat}", "multi-turn: the episode statistics, as in a rollout record"),
    ("infra/failed", "infra/failed", "samples whose sandbox could not run: left out of the mean, not passed in pass@k"),
]


def eval_name(set_name: str | None, metric: str) -> str:
    """The logged name of an eval set's ``metric`` (as ``Generation.evaluate`` names it): the
    default set's (``set_name`` None) under ``eval/`` as it is, ``eval/reward``; a named set's
    under ``eval/NAME/``, with its mean reward as ``eval/NAME/mean``."""
    if set_name is None:
        return f"{EVAL}{metric}"
    return f"{EVAL}{set_name}/{'mean' if metric == 'reward' else metric}"


def _eval_metrics() -> list[Metric]:
    out = []
    for default, named, meaning in _EVAL_SET:
        out.append(Metric(eval_name(None, default), "eval", f"the default eval set: {meaning}", EVALS))
        out.append(Metric(f"{EVAL}{{set}}/{named}", "eval", f"a named eval set: {meaning}", EVALS))
    return out


METRICS: list[Metric] = [Metric(n, "rollout", m, s) for n, m, s in _ROLLOUT] + _eval_metrics()


def find(kind: str, name: str) -> Metric | None:
    """The entry a logged ``name`` of a ``kind`` record is documented by; None if none is."""
    return next((m for m in METRICS if m.kind == kind and m.pattern.fullmatch(name)), None)


def undocumented(record: dict) -> list[str]:
    """The names in a ``metrics.jsonl`` record that no entry documents."""
    kind = record.get("kind", "rollout")
    return [k for k in record if k not in ("kind", "rollout_id") and find(kind, k) is None]


def eval_means(record: dict) -> dict[str, float]:
    """An eval record's mean reward per set, in the order logged: ``{"eval": ...}`` for the
    default set (``eval/reward``), ``{NAME: ...}`` for each named set (``eval/NAME/mean``)."""
    out = {}
    for key, value in record.items():
        if key == f"{EVAL}reward":
            out["eval"] = value
        elif key.startswith(EVAL) and key.endswith("/mean") and key.count("/") == 2:
            out[key[len(EVAL) : -len("/mean")]] = value
    return out


def upgrade_eval_record(record: dict) -> dict:
    """An eval record as logged before its names began with ``eval/`` (``reward``, ``NAME/mean``),
    named as now; a record of today unchanged."""
    if record.get("kind") != "eval" or any(k.startswith(EVAL) for k in record):
        return record
    return {k if k in ("kind", "rollout_id") else f"{EVAL}{k}": v for k, v in record.items()}
