"""A user's own data: every format rlhpc reads, keys where the user's files keep them (dotted for
nested fields, as verl's do), and a bad file refused at submit with file, row, key and fix."""

import json
import subprocess
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhpc.data.files import read_rows
from rlhpc.errors import ConfigError
from rlhpc.preflight import load_config

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
# verl's layout: the label nested under reward_model, other fields beside it
VERL_ROWS = [
    {"data_source": "gsm8k", "question": f"What is {i} + {i}?", "reward_model": {"ground_truth": 2 * i}}
    for i in range(5)
]
VERL_KEYS = ("question", "reward_model.ground_truth")


def write_each_format(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in VERL_ROWS))
    (tmp_path / "d.json").write_text(json.dumps(VERL_ROWS))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in VERL_ROWS))  # JSONL named .json
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), tmp_path / "d.parquet")
    datasets.Dataset.from_list(VERL_ROWS).save_to_disk(str(tmp_path / "saved"))
    return ["d.jsonl", "d.json", "lines.json", "d.parquet", "saved"]


def test_every_format_reads_the_same_rows_with_nested_keys(tmp_path):
    for name in write_each_format(tmp_path):
        rows = read_rows(tmp_path / name, *VERL_KEYS)
        assert rows == VERL_ROWS, name  # the file's rows as they are: every column, nested as in the file
        # what rlhpc derives, beside them: the label as text, the prompt as chat messages
        assert [r.label for r in rows] == [str(2 * i) for i in range(5)], name
        assert [r.messages for r in rows] == [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(5)]
        assert [r.prompt_text for r in rows] == [f"What is {i} + {i}?" for i in range(5)] and not rows[0].is_chat


def test_a_bad_file_names_file_row_and_key(tmp_path):
    names = write_each_format(tmp_path)
    for name in names:  # the default keys are not where verl keeps them
        with pytest.raises(ConfigError, match=r"has no 'prompt' \(its keys: 'data_source', 'question'"):
            read_rows(tmp_path / name)
    with pytest.raises(ConfigError, match=r"row 0 has no 'reward_model.truth'"):
        read_rows(tmp_path / "d.parquet", "question", "reward_model.truth")
    with pytest.raises(ConfigError, match=r"'reward_model' is \{\"ground_truth\": 0\}, not a text or number"):
        read_rows(tmp_path / "d.json", "question", "reward_model")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": 1}\n{"prompt": \n')
    with pytest.raises(ConfigError, match=r"bad.jsonl line 2 is not valid JSON"):
        read_rows(tmp_path / "bad.jsonl")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ConfigError, match=r"suffix '.csv'"):
        read_rows(tmp_path / "d.csv")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(VERL_ROWS)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ConfigError, match=r"(?s)holds the splits train.*dict/train"):
        read_rows(tmp_path / "dict", *VERL_KEYS)


def test_files_need_a_reward_of_their_own(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n")
    with pytest.raises(ConfigError, match="the toy task 'digit_sum''s reward would score your data") as e:
        load_config(None, ["model.tiny={}", f"data.train_file={tmp_path}/d.jsonl"])
    assert "rlhpc.rewards:math" in e.value.fix
    cfg = load_config(None, ["model.tiny={}", f"data.train_file={tmp_path}/d.jsonl", "data.reward=rlhpc.rewards:exact"])
    assert cfg.data.reward == "rlhpc.rewards:exact"


def test_a_bad_file_is_refused_by_submit_before_anything_is_written(tmp_path):
    write_each_format(tmp_path)
    run = tmp_path / "run"
    for extra in ([], ["--dry-run"]):
        p = subprocess.run(
            [sys.executable, str(REPO / "jobs" / "submit.py"), "--cluster", "local", "--run-dir", str(run), *extra,
             "--set", f"data.train_file={tmp_path}/d.parquet", "--set", "data.reward=rlhpc.rewards:math"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert p.returncode == 2, p.stdout + p.stderr
        said = " ".join((p.stdout + p.stderr).split())  # a terminal's wrapping undone
        assert "d.parquet row 0 has no 'prompt'" in said and "data.prompt_key" in said
        assert "Traceback" not in said and not run.exists()


def test_prompts_too_long_for_the_context_are_dropped_at_load(caplog):
    from rlhpc.driver import prompt_prep
    from rlhpc.model import build_char_tokenizer

    tok = build_char_tokenizer()
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "1+2=" * 40, "answer": "3"}]
    cfg = load_config(None, ["model.tiny={}", "data.max_prompt_tokens=5"])
    assert prompt_prep(cfg, tok, 128)("train", rows) == rows[:1]  # BOS + 4 characters = 5 tokens: kept
    assert "train data: 1 of 2 prompts are longer than 5 tokens and were dropped" in caplog.text
    with pytest.raises(ConfigError, match="every eval prompt is longer than 5 tokens"):
        prompt_prep(cfg, tok, 128)("eval", rows[1:])
    # without data.max_prompt_tokens: what the context leaves after each split's max_new_tokens
    cfg = load_config(None, ["model.tiny={}", "rollout.max_new_tokens=8", "eval.max_new_tokens=20"])
    long = [{"prompt": "1" * 107, "answer": "1"}]  # BOS + 107 = 108 tokens: eval's limit at context 128
    assert prompt_prep(cfg, tok, 128)("eval", long) == long and prompt_prep(cfg, tok, 127)("train", long) == long
    with pytest.raises(ConfigError):
        prompt_prep(cfg, tok, 127)("eval", long)
    assert prompt_prep(cfg, tok, None)("eval", rows) == rows  # no context known: nothing dropped


def test_the_guides_verl_snippet_reads_verls_gsm8k_layout(tmp_path, monkeypatch):
    """docs/guides/your-own-task.md's "a verl-format file trains as it is" config, as written,
    on files in verl's GSM8K layout (examples/make_verl_gsm8k.py): the question is in `prompt`
    as chat messages, not in a `question` column (issue 42)."""
    import yaml

    monkeypatch.syspath_prepend(str(REPO))
    from examples import make_verl_gsm8k

    guide = (REPO / "docs" / "guides" / "your-own-task.md").read_text()
    block = guide.split("A verl-format file trains as it is", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    make_verl_gsm8k.main([str(tmp_path / "data" / "gsm8k"), "--train", "4", "--test", "2"])
    monkeypatch.chdir(tmp_path)  # the snippet's paths are relative, as a user's are
    cfg = load_config(
        None, ["model.tiny={tokenizer: bpe}"] + [f"data.{k}={v}" for k, v in yaml.safe_load(block)["data"].items()]
    )
    rows = read_rows(cfg.data.train_file, cfg.data.prompt_key, cfg.data.label_key)
    assert all(r.is_chat and r.label == r["reward_model"]["ground_truth"] for r in rows)
    assert rows[0]["data_source"] == "openai/gsm8k" and "####" in rows[0].messages[0]["content"]
