"""The generative judge (issue 30, ``reward_model.kind: judge``): its config, the built-in prompt
and parse, and the requests it sends (rendered, seeded, batched, held to the judge's context)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlhpc.config import JudgeSamplingConfig, RewardModelConfig
from rlhpc.errors import ConfigError
from rlhpc.model import build_bpe_tokenizer, build_char_tokenizer
from rlhpc.preflight import config_from_dict
from rlhpc.rollout.judge import Judge, parse_score, render, score_prompt
from rlhpc.rollout.reward_model import EMBEDDING_FLAG, reward_rollout_config
from rlhpc.rollout.scoring import Sample

REPO = Path(__file__).resolve().parents[2]


def _cfg(**rm):
    return config_from_dict(
        {"model": {"tiny": {}}, "cluster": {"gpus_per_node": 3}, "reward_model": {"tiny": {}, "kind": "judge", **rm}}
    )


@pytest.mark.parametrize(
    "text, score",
    [("7", 0.7), ("Score: 8/10", 1.0), ("I'd say 4.5.", 0.45), ("15", 1.0), ("-3", 0.0), ("no verdict", 0.0)],
)
def test_the_built_in_parse_reads_the_last_number_as_a_fraction_of_ten(text, score):
    assert parse_score(text) == pytest.approx(score)


def test_the_built_in_prompt_holds_the_task_and_the_response_and_asks_last():
    (m,) = score_prompt(Sample(prompt="1+2=", response="3", label="3"))
    assert m["role"] == "user" and "Task:\n1+2=" in m["content"] and "Response:\n3" in m["content"]
    assert m["content"].endswith("Answer with the number only.")


def test_a_judge_config_resolves_its_functions_and_takes_its_own_sampling():
    rm = _cfg(judge_parse="support.judges:length", sampling={"max_new_tokens": 8, "stop": ["\n"]}).reward_model
    assert rm.prompt_spec == "rlhpc.rollout.judge:score_prompt" and rm.parse_spec == "support.judges:length"
    assert rm.sampling.temperature == 0.0 and rm.sampling.max_new_tokens == 8
    r = reward_rollout_config(_cfg().rollout, _cfg(backend="sglang").reward_model)
    assert EMBEDDING_FLAG not in r.sglang.extra_args  # a judge is served as the chat model it is


@pytest.mark.parametrize(
    "rm, match",
    [
        ({"judge_prompt": "support.judges:nothing"}, r"reward_model\.judge_prompt = 'support\.judges:nothing' cannot"),
        ({"judge_parse": "no_colon"}, r"reward_model\.judge_parse = 'no_colon' is not 'module:function'"),
        ({"sampling": {"top_p": 0}}, r"reward_model\.sampling\.top_p"),
        ({"sampling": {"max_new_tokens": 0}}, r"reward_model\.sampling\.max_new_tokens"),
    ],
)
def test_a_bad_judge_is_refused_at_submit_with_the_key_and_the_fix(rm, match):
    with pytest.raises(ConfigError, match=match) as e:
        _cfg(**rm)
    assert e.value.fix


def test_requests_are_the_judges_template_with_a_generation_prompt_seeded_by_the_question():
    tok = build_bpe_tokenizer()
    rm = RewardModelConfig(tiny={}, kind="judge", batch_size=2, sampling=JudgeSamplingConfig(max_new_tokens=4, top_k=5))
    judge = Judge(None, tok, rm, seed=1)
    samples = [Sample(prompt="1+2=", response=r, label="3") for r in ("3", "4", "3")]
    requests = judge.requests(samples)
    assert [len(r.input_ids) for r in requests] == [2, 1] and not requests[0].return_logprob
    first = tok.decode(requests[0].input_ids[0])
    assert first.startswith("<|im_start|>user\nHere is a task") and first.endswith("<|im_start|>assistant\n")
    p = [sp for r in requests for sp in r.sampling_params]
    assert p[0]["max_new_tokens"] == 4 and p[0]["temperature"] == 0.0 and p[0]["top_k"] == 5
    # the same question, the same seed (in a rerun too); another question, another
    assert p[0]["sampling_seed"] == p[2]["sampling_seed"] != p[1]["sampling_seed"]
    assert Judge(None, tok, rm, seed=1).requests(samples)[1].sampling_params == requests[1].sampling_params
    assert Judge(None, tok, rm, seed=2).requests(samples)[1].sampling_params != requests[1].sampling_params


def test_a_long_question_keeps_its_end_and_leaves_room_for_the_answer():
    tok = build_char_tokenizer()  # no template: the contents, with the special tokens
    rm = RewardModelConfig(tiny={}, kind="judge", sampling=JudgeSamplingConfig(max_new_tokens=10))
    judge = Judge(None, tok, rm, seed=0, context_len=40)
    (ids,) = judge.requests([Sample(prompt="x" * 100, response="y", label="")])[0].input_ids
    assert len(ids) == 30 and ids == render(tok, score_prompt(Sample(prompt="x" * 100, response="y", label="")))[-30:]
    assert judge.truncated == 1


def test_the_judges_dry_run_shows_its_engines_launched_as_chat_models(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--run-dir", str(run), "--nodes", "1",
         "--gpus-per-node", "4", "--set", "reward_model.tiny.seed=1", "--set", "reward_model.kind=judge",
         "--set", "reward_model.backend=sglang", "--set", "reward_model.judge_parse=support.judges:length"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "1 reward engine(s)" in p.stdout and "judge_parse: support.judges:length" in p.stdout
    line = p.stdout.split("reward engine 0's launch line (each reward engine's alike):\n", 1)[1].splitlines()[0]
    assert "--model-path <run dir>/reward_model" in line and EMBEDDING_FLAG not in line
    assert not run.exists()


def test_checking_a_judge_config_does_not_import_ray():
    """The job checks its config before it sets Ray's token auth, which ray reads when first
    imported: the judge's functions are resolved then, so nothing on that path may import ray."""
    code = (
        "import sys; from rlhpc.preflight import config_from_dict; config_from_dict({'model': {'tiny': {}}, "
        "'cluster': {'gpus_per_node': 3}, 'reward_model': {'tiny': {}, 'kind': 'judge'}}); print('ray' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"
