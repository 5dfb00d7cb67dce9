"""Named eval sets (``eval.sets``): parsed into a typed section per set, the old keys read as the
one set ``default`` whose metrics keep their names, and a bad set refused before anything is submitted."""

import json
import subprocess
import sys

import pytest

from rlhpc.config import DEFAULT_EVAL_SET, EvalSetConfig
from rlhpc.errors import ConfigError
from rlhpc.metric_names import eval_means, eval_name, upgrade_eval_record
from rlhpc.preflight import load_config

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
TINY = ["model.tiny={}", "rollout.max_new_tokens=4"]


def write_rows(path, prompt_key="prompt", label_key="answer"):
    path.write_text("".join(json.dumps({prompt_key: f"{i}+{i}=", label_key: 2 * i}) + "\n" for i in range(3)))
    return path


def test_sets_are_parsed_each_key_falling_back_to_the_old_ones(tmp_path):
    q = write_rows(tmp_path / "q.jsonl", "question", "solution")
    cfg = load_config(
        None,
        [*TINY, "data.reward=rlhpc.rewards:exact", "eval.temperature=0.5", "eval.n_samples_per_prompt=2",
         f"eval.sets.hard.file={q}", "eval.sets.hard.prompt_key=question", "eval.sets.hard.label_key=solution",
         "eval.sets.hard.n_samples_per_prompt=8", "eval.sets.hard.temperature=1.0", "eval.sets.toy.max_new_tokens=2"],
    )  # fmt: skip
    assert isinstance(cfg.eval.sets["hard"], EvalSetConfig)
    sets = cfg.eval.resolved_sets(cfg.data, cfg.rollout)
    assert list(sets) == ["hard", "toy"]
    assert sets["hard"] == EvalSetConfig(str(q), "question", "solution", 8, 1.0, 4, -1, 0.0, 1.0, [])
    # unset keys: data.prompt_key/label_key, eval.n_samples_per_prompt/temperature, rollout.max_new_tokens
    assert sets["toy"] == EvalSetConfig(None, "prompt", "answer", 2, 0.5, 2, -1, 0.0, 1.0, [])


def test_the_old_keys_are_one_set_that_keeps_todays_metric_names(tmp_path):
    f = write_rows(tmp_path / "e.jsonl")
    cfg = load_config(None, [*TINY, f"data.eval_file={f}", "data.reward=rlhpc.rewards:exact", "eval.max_new_tokens=3"])
    assert cfg.eval.resolved_sets(cfg.data, cfg.rollout) == {
        DEFAULT_EVAL_SET: EvalSetConfig(str(f), "prompt", "answer", 1, 0.0, 3, -1, 0.0, 1.0, [])
    }
    assert [eval_name(None, k) for k in ("reward", "pass@1", "maj@4")] == ["eval/reward", "eval/pass@1", "eval/maj@4"]
    assert [eval_name("gsm8k", k) for k in ("reward", "pass@2", "maj@4")] == [
        "eval/gsm8k/mean",
        "eval/gsm8k/pass@2",
        "eval/gsm8k/maj@4",
    ]
    old_record = {"kind": "eval", "rollout_id": 3, "reward": 0.5, "response_len": 1.0}
    new_record = upgrade_eval_record(old_record)  # status and plot read runs logged before the eval/ names
    assert new_record == {"kind": "eval", "rollout_id": 3, "eval/reward": 0.5, "eval/response_len": 1.0}
    assert eval_means(new_record) == {"eval": 0.5}
    assert eval_means(upgrade_eval_record({"kind": "eval", "a/mean": 0.1, "a/pass@1": 0.1, "b/mean": 0.2})) == {
        "a": 0.1,
        "b": 0.2,
    }
    assert eval_means({"eval/a/mean": 0.1, "eval/a/pass@1": 0.1, "eval/b/mean": 0.2}) == {"a": 0.1, "b": 0.2}


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("eval.sets.a.temperature=-1", r"eval.sets.a.temperature = -1.0 must be >= 0"),
        ("eval.sets.a.n_samples_per_prompt=0", r"eval.sets.a.n_samples_per_prompt = 0 must be >= 1"),
        ("eval.sets.a.tempreature=1", r"unknown config key 'eval.sets.a.tempreature'"),
        ("eval.sets.a/b.temperature=1", r"a set named 'a/b'"),
        ("eval.sets=[a, b]", r"eval.sets must be a mapping"),
        ("eval.sets.a.max_new_tokens=500", r"eval.sets.a.max_new_tokens = 500 \+ a prompt token exceeds"),
        ("eval.sets.a.file=/no/such.jsonl", r"eval.sets.a.file /no/such.jsonl does not exist"),
    ],
)
def test_a_bad_set_is_one_error_naming_its_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [*TINY, "data.reward=rlhpc.rewards:exact", override])


def test_set_files_need_a_reward_and_eval_file_does_not_mix_with_sets(tmp_path):
    f = write_rows(tmp_path / "e.jsonl")
    with pytest.raises(ConfigError, match=r"eval.sets.a.file set but data.reward is not"):
        load_config(None, [*TINY, f"eval.sets.a.file={f}"])
    with pytest.raises(ConfigError, match=r"data.eval_file and eval.sets are both set") as e:
        load_config(None, [*TINY, "data.reward=rlhpc.rewards:exact", f"data.eval_file={f}", "eval.sets.a.file=null"])
    assert "eval.sets.default.file" in e.value.fix


def test_a_bad_set_file_is_refused_by_submit_before_anything_is_written(tmp_path):
    f = write_rows(tmp_path / "e.jsonl", "question", "answer")
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--cluster", "local", "--run-dir", str(run), "--dry-run",
         "--set", "data.reward=rlhpc.rewards:exact", "--set", "eval.sets.ok.file=null",
         "--set", f"eval.sets.bad.file={f}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2, said
    assert "e.jsonl line 1 has no 'prompt'" in said and "Traceback" not in said and not run.exists()


def test_rlhpc_eval_adds_a_set_to_a_run_that_used_data_eval_file(tmp_path):
    """rlhpc-eval RUN --set eval.sets.X.file=... on a run with data.eval_file (issue 42, item 6):
    the new set runs beside the run's own eval file, which keeps its metric names (before: refused,
    "data.eval_file and eval.sets are both set")."""
    from rlhpc.cli.evaluate import eval_config
    from rlhpc.config import dump_config
    from rlhpc.run_dir import RunDir

    f, hard = write_rows(tmp_path / "e.jsonl"), write_rows(tmp_path / "hard.jsonl", "q", "a")
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.config_file.write_text(
        dump_config(load_config(None, [*TINY, f"data.eval_file={f}", "data.reward=rlhpc.rewards:exact"]))
    )
    cfg = eval_config(run, [f"eval.sets.hard.file={hard}", "eval.sets.hard.prompt_key=q", "eval.sets.hard.label_key=a"])
    sets = cfg.eval.resolved_sets(cfg.data, cfg.rollout)
    assert list(sets) == [DEFAULT_EVAL_SET, "hard"] and sets[DEFAULT_EVAL_SET].file == str(f)
    assert sets["hard"].file == str(hard) and sets["hard"].prompt_key == "q"
    assert eval_config(run, []).eval.sets == {}  # without new sets: the run's config as it is
