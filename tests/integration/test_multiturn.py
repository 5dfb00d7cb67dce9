"""A short local job on the built-in multi-turn task (guess): what was trained is what the
engine generated, token for token, and the loss mask is 0 exactly over the observations."""

import re

import h5py
import torch
from support.jobs import rollouts, submit
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhpc.metrics import read_metrics

OBSERVATION = re.compile(
    r"(<\|im_end\|>)?\n<\|im_start\|>user\n(higher|lower|a digit)<\|im_end\|>\n<\|im_start\|>assistant\n"
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


def test_guess_episodes_train_the_engines_tokens(tmp_path):
    run = tmp_path / "run"
    p = submit(
        run, "data.task=guess", "model.tiny.tokenizer=bpe", "rollout.num_rollout=2", "rollout.max_turns=3",
        "rollout.max_new_tokens=4", "rollout.max_episode_tokens=48", "eval.interval=null",
        "checkpoint.save_interval=null",
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert rollouts(run) == [0, 1]
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
