"""The tiny models' tokenizers as real models ship them: the character one with a BOS its own
post-processor adds (as Llama's), the byte-level BPE without one (as Qwen's), and prompts
encoded with the special tokens each tokenizer itself adds, never an assumed BOS."""

import json

import pytest
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from rlhpc.config import TinyModelConfig
from rlhpc.data.prompts import encode_prompts
from rlhpc.errors import RlhpcError
from rlhpc.model import IM_END, build_bpe_tokenizer, build_char_tokenizer, build_tiny_model


def test_the_char_tokenizer_adds_its_bos_itself():
    tok = build_char_tokenizer()
    plain = tok(["3+4=", "abc:"], add_special_tokens=False).input_ids
    assert encode_prompts(tok, ["3+4=", "abc:"]) == [[tok.bos_token_id, *ids] for ids in plain]


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("bpe") / "tiny", TinyModelConfig(tokenizer="bpe"))


def test_the_bpe_model_is_shaped_as_qwen_ships(bpe_model):
    tok = AutoTokenizer.from_pretrained(bpe_model)  # as the engines and the actor load it
    assert tok.bos_token is None and tok.eos_token == IM_END and tok.pad_token == "<|endoftext|>"
    config = json.loads((bpe_model / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] == tok.eos_token_id
    assert config["vocab_size"] == len(tok)
    ids = encode_prompts(tok, ["3+4=", "abc:"])
    assert ids == tok(["3+4=", "abc:"]).input_ids and all(i[0] != tok.eos_token_id for i in ids)
    chat = [{"role": "user", "content": "3+4="}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_ids_to_tokens(encode_prompts(tok, [text])[0])[0] == "<|im_start|>"  # one special token


def test_every_byte_has_a_token_and_text_decodes_back():
    tok = build_bpe_tokenizer()
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(tok.get_vocab())  # all 256 bytes
    for text in [chr(c) for c in range(128)] + ["caf\u00e9", "\u2211 x\u00b2", "a\x00b"]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert ids and tok.decode(ids) == text
    nul = tok.convert_tokens_to_ids("\u0100")  # the byte-level alphabet's name for byte 0
    assert tok.decode([nul]) == "\x00"


def test_the_bpe_tokenizer_is_a_pure_function_of_its_seed():
    assert build_bpe_tokenizer(0).get_vocab() == build_bpe_tokenizer(0).get_vocab()


def test_a_prompt_that_encodes_to_nothing_is_named():
    with pytest.raises(RlhpcError, match="encodes to no tokens"):
        encode_prompts(build_bpe_tokenizer(), ["3+4=", ""])


def test_make_tiny_model_builds_the_bpe_model_and_refuses_an_unknown_tokenizer(tmp_path):
    from rlhpc.cli.make_tiny_model import main

    assert main([str(tmp_path / "m"), "--tokenizer", "bpe", "--architecture", "qwen2"]) == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "m").eos_token == IM_END
    assert main([str(tmp_path / "w"), "--tokenizer", "wordpiece"]) == 2 and not (tmp_path / "w").exists()
