"""Chat-message prompts rendered with a chat template once, on the driver: the ids sent are the
ids ``transformers``' ``apply_chat_template`` gives, never the rendered text encoded again (which
would add a second BOS to a template that writes its own)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhpc.data.files import read_rows
from rlhpc.data.prompts import encode_rows, prepare_prompts
from rlhpc.errors import ConfigError
from rlhpc.model import build_bpe_tokenizer, build_char_tokenizer
from rlhpc.preflight import load_config

CHAT = [{"role": "user", "content": "3+4="}]


def data_cfg(*overrides):
    return load_config(None, ["model.tiny={}", *overrides]).data


def test_chat_rows_get_the_ids_apply_chat_template_gives():
    tok = build_bpe_tokenizer()  # ChatML template, no BOS (Qwen's shape)
    rows = [{"prompt": CHAT, "answer": "7"}, {"prompt": "1+2=", "answer": "3"}]
    ready = prepare_prompts(tok, data_cfg(), None)("train", rows)
    want = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert encode_rows(tok, ready) == [want, tok("1+2=").input_ids]
    assert ready[0].prompt_text == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert ready[0].messages == CHAT and ready[1] == rows[1]  # a text prompt is left as it is
    assert ready[0] == rows[0]  # the row's own columns as the file has them: the prompt still the chat


def test_a_template_that_writes_its_own_bos_is_not_given_a_second(tmp_path):
    tok = build_char_tokenizer()  # its encodings start with BOS, as Llama's do
    template = tmp_path / "t.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ready = prepare_prompts(tok, data_cfg(f"data.chat_template={template}"), None)(
        "train", [{"prompt": CHAT, "answer": "7"}]
    )
    ids = encode_rows(tok, ready)[0]
    assert ids == [tok.bos_token_id, *tok("3+4=", add_special_tokens=False).input_ids]
    assert tok(ready[0].prompt_text).input_ids[:2] == [tok.bos_token_id] * 2  # what encoding the text again would send


def test_the_system_prompt_goes_first_where_there_is_none():
    tok = build_bpe_tokenizer()
    rows = [{"prompt": CHAT, "answer": "7"}, {"prompt": [{"role": "system", "content": "mine"}, *CHAT], "answer": "7"}]
    ready = prepare_prompts(tok, data_cfg("data.system_prompt=add"), None)("train", rows)
    assert ready[0].prompt_text.startswith("<|im_start|>system\nadd<|im_end|>\n<|im_start|>user\n3+4=")
    assert ready[1].prompt_text.startswith("<|im_start|>system\nmine<|im_end|>") and "add" not in ready[1].prompt_text


def test_chat_files_read_and_bad_ones_refused(tmp_path):
    rows = [{"messages": CHAT, "label": 7}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    (row,) = read_rows(tmp_path / "chat.parquet", "messages", "label")
    assert row == {"messages": CHAT, "label": 7} and row.messages == CHAT and row.label == "7" and row.is_chat
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user"}], "label": 7}) + "\n")
    with pytest.raises(ConfigError, match="bad.jsonl line 1: 'messages' is .* neither a text nor a list of chat"):
        read_rows(tmp_path / "bad.jsonl", "messages", "label")
    chat_file = [f"data.train_file={tmp_path}/chat.parquet", "data.prompt_key=messages", "data.label_key=label"]
    with pytest.raises(ConfigError, match="has chat-message prompts but data.chat_template is none"):
        load_config(None, ["model.tiny={}", *chat_file, "data.reward=rlhpc.rewards:exact", "data.chat_template=none"])
    with pytest.raises(ConfigError, match="neither auto, none, nor an existing file"):
        load_config(None, ["model.tiny={}", f"data.chat_template={tmp_path}/missing.jinja"])
    with pytest.raises(ConfigError, match="tokenizer ships no chat template"):
        prepare_prompts(build_char_tokenizer(), data_cfg(), None)("train", [{"prompt": CHAT, "answer": "7"}])
