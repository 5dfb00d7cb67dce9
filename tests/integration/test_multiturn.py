"""Short local jobs on the built-in multi-turn task (guess): what was trained is what the
engine generated, token for token, and the loss mask is 0 exactly over the observations; a
SIGKILL of the job or of an engine in the middle of episodes ends like the undisturbed run, also
with a tool that reads a clock outside the job (the tool journal); a weight push between two
turns shows in the tokens' versions, within the staleness bound."""

import os
import re
import subprocess
from pathlib import Path

import h5py
import pytest
import torch
from support.guess_envs import KILL_ENGINE_ENV, WAIT_PUSH_ENV
from support.hold import CLOCK_ENV, MID_EPISODE
from support.jobs import REPO, job_args, kill_when, rollouts, routed
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhpc.checkpoint import CheckpointManager
from rlhpc.invariants import comparable, final_weights
from rlhpc.metrics import read_metrics
from rlhpc.runtime.restarts import read_history

GUESS = (
    "data.task=guess", "model.tiny.tokenizer=bpe", "rollout.max_turns=3", "rollout.max_new_tokens=4",
    "rollout.max_episode_tokens=48", "eval.interval=null",
)  # fmt: skip
# Two engines: an episode's turns keep to one, and a request is one batch on the CPU engine,
# whose padded batches make tokens depend on what shares a batch, so runs compare like for like.
# A reply without a digit reads a clock outside the job (support.hold:now, one clock per episode,
# ticking at every reading) instead of guessing: what a resumed run replays of it comes from the
# tool journal. (The template leaves the tools' schemas out: the tiny context has no room for
# them, and the parser, not the model, decides what calls the clock.)
EXACT = (
    *GUESS, "deterministic=true", "rollout.num_rollout=4", "checkpoint.save_interval=2", "cluster.gpus_per_node=3",
    "cluster.rollout_num_gpus=2", "rollout.tools=[support.hold:now]", "rollout.tool_parser=support.hold:clock_calls",
    f"data.chat_template={REPO}/tests/support/chatml_without_tools.jinja",
)  # fmt: skip

OBSERVATION = re.compile(
    r"(<\|im_end\|>)?\n<\|im_start\|>(user\n(higher|lower|a digit)|tool\nt\d+)<\|im_end\|>\n<\|im_start\|>assistant\n"
)


def runs(values, mask, want):
    """The maximal runs of ``values`` where ``mask`` is ``want``."""
    out, cur = [], []
    for v, m in zip(values, mask):
        if m == want:
            cur.append(v)
        elif cur:
            out, cur = [*out, cur], []
    return [*out, cur] if cur else out


def test_guess_episodes_train_the_engines_tokens(undisturbed):
    """Read from the undisturbed run's first rollout (generated with the base weights): its
    observations are the environment's answers and the clock tool's readings."""
    run = undisturbed
    logged = [m for m in read_metrics(run) if m["kind"] == "rollout"]
    assert all({"episode/turns", "episode/truncated", "episode/observation_tokens"} <= set(m) for m in logged)
    assert any(m["episode/observation_tokens"] > 0 for m in logged)

    tok = AutoTokenizer.from_pretrained(run / "base_model")
    model = AutoModelForCausalLM.from_pretrained(run / "base_model", dtype=torch.float32)
    with h5py.File(run / "rollouts" / "rollout_000000.h5") as f:  # generated with the base weights
        prompts, responses = [list(x) for x in f["prompt_ids"][:]], [list(x) for x in f["response_ids"][:]]
        masks, turns = [list(x) for x in f["loss_mask"][:]], [list(x) for x in f["turn"][:]]
        logprobs = [list(x) for x in f["rollout_logprobs"][:]]
    multi = 0
    for prompt, response, mask, turn, lps in zip(prompts, responses, masks, turns, logprobs):
        # masked 0: exactly the template's tokens for an observation and the next generation prompt
        observations = runs(response, mask, 0)
        assert all(OBSERVATION.fullmatch(tok.decode(o)) for o in observations)
        assert len(observations) == max(turn) and len(runs(response, mask, 1)) == max(turn) + 1
        multi += bool(observations)
        # masked 1: the engine's tokens in the engine's context: the logprob it reported for each is
        # the base model's logprob of that token after everything before it in the trained sequence
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            ours = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        ours = ours[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None])[:, 0]
        for t, (m, lp) in enumerate(zip(mask, lps)):
            assert abs(ours[t].item() - lp) < 1e-3 if m else lp == 0.0
    assert multi > 0  # some episodes went on after a wrong guess


def run_job(run: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(
        job_args(run, *overrides), capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def clocks(run: Path) -> dict[str, str]:
    """The environment of a run whose clocks (support.hold:now) live beside its run dir."""
    (run.parent / "clocks").mkdir(parents=True, exist_ok=True)
    return {CLOCK_ENV: str(run.parent / "clocks")}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("guess") / "run"
    run_job(run, *EXACT, env=clocks(run))
    records = [m for m in read_metrics(run) if m["kind"] == "rollout"]
    assert any(m["episode/turns"] > 1 for m in records) and all(m["episode/tool_calls"] > 0 for m in records)
    assert routed(run)  # every turn through the real router
    return run


@pytest.fixture(scope="module")
def killed_then_engine_killed(tmp_path_factory) -> tuple[Path, str, dict]:
    """One run for two faults between two turns of its episodes: the whole job SIGKILLed in its
    first start (once rollout 1's checkpoint exists), engine 0's server SIGKILLed in its resumed
    one (in rollout 2, the first it trains). The run dir, what the resumed start printed, and what
    was seen before it."""
    run = tmp_path_factory.mktemp("guess-faults") / "run"
    faults = (*EXACT, "rollout.env=support.hold:HeldThenEngineKilling")
    # once rollout 1's checkpoint exists, the next episode step holds, and the kill comes there
    held = run / "checkpoints" / f"rollout_000001{MID_EPISODE}"
    kill_when(job_args(run, *faults), held, env=clocks(run))
    engine_log = run / "logs" / "engines" / "engine_0.log"
    before = {
        "held": held.read_text(),
        "latest": CheckpointManager(run / "checkpoints", 2).latest(),
        "engine_starts": engine_log.read_text().count("starting at"),
        "killed_engine": Path(f"{engine_log}.killed").exists(),
        "journal": sorted(p.name for p in (run / "tool_journal").glob("*.jsonl")),
    }
    # no hold: the resumed job runs on; its clocks are where the first start left them
    p = run_job(run, *faults, env={KILL_ENGINE_ENV: str(engine_log), **clocks(run)})
    return run, p.stdout + p.stderr, before


def test_sigkill_in_the_middle_of_episodes_resumes_to_the_same_run(undisturbed, killed_then_engine_killed):
    """Episodes run within a rollout and checkpoints fall between rollouts, so the episodes a
    kill cuts are replayed whole from their seeds: same tokens, same rewards, same weights. The
    clock the tool reads went on while the job was down (it ticked at every reading of the first
    start): the calls the replayed episodes made before the kill are answered from the tool
    journal, as they were, and only the calls after it read the clock."""
    run, out, before = killed_then_engine_killed
    assert before["held"].startswith("held after reply")  # between two turns of an episode
    assert any(name >= "rollout_000002" for name in before["journal"]), before["journal"]  # the cut rollouts'
    assert "tool call(s) answered from the journal" in out, out[-3000:]
    ck = before["latest"]
    assert ck is not None and ck.rollout_id == 1
    assert f"resuming from {ck.path.name}" in out
    assert len(read_history(run)) == 2
    assert rollouts(run) == [0, 1, 2, 3]
    assert comparable(run) == comparable(undisturbed)
    assert final_weights(run) == final_weights(undisturbed)


def test_engine_killed_in_the_middle_of_episodes_ends_like_the_undisturbed_run(undisturbed, killed_then_engine_killed):
    """Each episode's turns on one of the two engines; engine 0's server is SIGKILLed between
    two turns of the resumed start's first rollout: its episodes' next requests fail, it is
    restarted on the current weights and they are sent again, with the same per-sample seeds,
    so the same tokens."""
    run, out, before = killed_then_engine_killed
    engine_log = run / "logs" / "engines" / "engine_0.log"
    assert not before["killed_engine"] and Path(f"{engine_log}.killed").exists(), out[-3000:]
    # started once by the resumed job and restarted once
    assert engine_log.read_text().count("starting at") == before["engine_starts"] + 2, out[-3000:]
    assert "generation request(s) again" in out, out[-3000:]
    assert len(read_history(run)) == 2  # the job itself restarted only for its own SIGKILL
    assert comparable(run) == comparable(undisturbed)
    assert final_weights(run) == final_weights(undisturbed)


def test_a_push_between_turns_shows_in_each_tokens_version_within_the_bound(tmp_path):
    """Partial rollouts (a push does not wait for the rollout in flight), staleness 1: from
    rollout 1 on, each episode waits after its first reply until the next weights were pushed.
    Its later turns are generated with them; every token keeps the version it was sampled with
    (an observation's, the reply's before it), and the episode stays within the bound."""
    run = tmp_path / "run"
    run_job(
        run, *GUESS, "rollout.env=support.guess_envs:PushWaitingGuess", "rollout.max_staleness=1",
        "rollout.partial_rollout=true", "rollout.num_rollout=3", "checkpoint.save_interval=null",
        env={WAIT_PUSH_ENV: str(run)},
    )  # fmt: skip
    straddling = 0
    for r in range(3):
        with h5py.File(run / "rollouts" / f"rollout_{r:06d}.h5") as f:
            versions = [t.tolist() for t in f["token_versions"][:]]
            turns = [t.tolist() for t in f["turn"][:]]
            per_episode = f["weight_versions"][:].tolist()
        for tokens, turn, oldest in zip(versions, turns, per_episode):
            assert tokens == sorted(tokens) and all(0 <= r - v <= 1 for v in tokens), (r, tokens)
            assert min(tokens) == oldest
            first = {v for v, t in zip(tokens, turn) if t == 0}
            later = {v for v, t in zip(tokens, turn) if t > 0}
            straddling += r >= 1 and first == {r - 1} and later == {r}
    assert straddling > 0  # some episodes' later turns had newer weights than their first
    records = [m for m in read_metrics(run) if m["kind"] == "rollout"]
    assert all(m["staleness/max"] <= 1.0 for m in records)
    assert any(m["staleness/straddling"] > 0 for m in records)
