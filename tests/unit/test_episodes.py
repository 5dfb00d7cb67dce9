"""Multi-turn episodes (rollout.env): incremental token-in/token-out rendering checked against
``transformers``' ``apply_chat_template`` of the whole conversation, the per-token loss mask, the
built-in guess environment, and a whole rollout of episodes through an in-process CPU engine."""

import h5py
import pytest
import torch
from support.engines import in_process_send
from tokenizers import AddedToken

from rlhpc.batch import RolloutBatch
from rlhpc.config import TinyModelConfig
from rlhpc.data.guess import GuessEnv
from rlhpc.data.rows import as_row
from rlhpc.errors import ConfigError
from rlhpc.metrics import write_rollout_dump
from rlhpc.model import IM_END, build_bpe_tokenizer, build_tiny_model
from rlhpc.preflight import load_config
from rlhpc.rollout.episodes import (
    Conversation,
    TemplateBreaksPrefix,
    extend_all,
    make_episodes,
    resolve_env,
    split_tokens,
)
from rlhpc.rollout.generation import Generation

USER = [{"role": "user", "content": "guess 1-8"}]


def whole(tok, messages, generation_prompt):
    return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, return_dict=False)


def test_observations_are_appended_as_the_whole_conversation_renders_them():
    tok = build_bpe_tokenizer()
    eos = tok.convert_tokens_to_ids(IM_END)
    chat = Conversation(tok, tok.chat_template, "t", USER)
    assert chat.prompt_ids == whole(tok, USER, True)
    stream, mask, messages = list(chat.prompt_ids), [], list(USER)
    # the engine's replies: one that stopped (<|im_end|> generated) and one cut at max_new_tokens
    for reply, stopped, hint in (("3 then", True, "higher"), ("5", False, "lower"), ("4", True, None)):
        generated = tok.encode(reply, add_special_tokens=False) + ([eos] if stopped else [])
        stream += generated
        mask += [1] * len(generated)
        messages.append({"role": "assistant", "content": reply})
        if hint is None:
            break
        extra = chat.extend(generated, reply, [{"role": "user", "content": hint}])
        stream += extra
        mask += [0] * len(extra)
        messages.append({"role": "user", "content": hint})
        assert stream == whole(tok, messages, True)  # token for token, the generation prompt included
        # only the template's own tokens were added: the stop token the engine produced is not doubled
        assert extra[0] == (tok.encode("\n")[0] if stopped else eos)
    full = whole(tok, messages, False)
    assert stream == full[: len(stream)] and tok.decode(full[len(stream) :]) == "\n"
    # the mask is 1 exactly over the replies' tokens
    replies = [t for t, m in zip(stream[len(chat.prompt_ids) :], mask) if m]
    want = [*tok.encode("3 then"), eos, *tok.encode("5"), *tok.encode("4"), eos]
    assert replies == want


def test_a_template_that_strips_earlier_replies_is_refused_naming_it(tmp_path):
    tok = build_bpe_tokenizer()
    # a reasoning-style template: earlier assistant turns lose their text
    strip = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ '<|im_start|>assistant\\n<|im_end|>\\n' }}{% else %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    chat = Conversation(tok, strip, "strip.jinja", USER)
    reply = tok.encode("3", add_special_tokens=False) + [tok.convert_tokens_to_ids(IM_END)]
    with pytest.raises(TemplateBreaksPrefix, match="strip.jinja renders earlier turns differently"):
        chat.extend(reply, "3", [{"role": "user", "content": "higher"}])


# Qwen2.5's layout: a default system message, the tools listed in it, consecutive tool answers
# in one user turn
QWEN_STYLE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = 'You are a helpful assistant.' %}{% set rest = messages %}{% endif %}"
    "<|im_start|>system\n{{ system }}{% if tools %}\n\n# Tools\n\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>{% endif %}<|im_end|>\n"
    "{% for m in rest %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# no added token anywhere: no tail of the chat starts at a split, every turn is tokenized whole
PLAIN = (
    "{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def play(tok, template, tools, turns):
    """Run ``turns`` (reply, engine stopped, observation) through a Conversation; at every turn
    the stream must be the whole chat's ids as ``apply_chat_template`` gives them."""
    eos = tok.convert_tokens_to_ids(IM_END)
    chat = Conversation(tok, template, "t", USER, tools)
    stream, messages = list(chat.prompt_ids), list(USER)
    for reply, stopped, observation in turns:
        generated = tok.encode(reply, add_special_tokens=False) + ([eos] if stopped else [])
        stream += generated + chat.extend(generated, reply, observation)
        messages += [{"role": "assistant", "content": reply}, *observation]
        want = tok.apply_chat_template(messages, chat_template=template, tools=tools, add_generation_prompt=True)
        assert stream == list(want["input_ids"])
    return chat


def test_only_tails_are_tokenized_and_give_the_whole_chats_ids():
    tok = build_bpe_tokenizer()
    # replies BPE could merge across a boundary: spaces, digits, non-ASCII, a special token's text
    turns = [
        ("3 then", True, [{"role": "user", "content": "higher"}]),
        (" 5 ", False, [{"role": "user", "content": "lower\n"}]),
        ("4é <|im_start|>x", True, [{"role": "user", "content": " 4?"}, {"role": "user", "content": "again"}]),
        ("2", True, [{"role": "user", "content": "yes"}]),
    ]
    assert play(tok, tok.chat_template, None, turns).whole_tokenized == 0
    tool_turns = [
        ('<tool_call>\n{"name": "add"}\n</tool_call>', True, [{"role": "tool", "content": "2"}]),
        ("two calls", True, [{"role": "tool", "content": "3"}, {"role": "tool", "content": " 4"}]),
        ("7", False, [{"role": "user", "content": "done?"}]),
    ]
    assert play(tok, QWEN_STYLE, TOOLS, tool_turns).whole_tokenized == 0


def test_a_chat_without_split_tokens_is_tokenized_whole():
    tok = build_bpe_tokenizer()
    turns = [
        ("3 then", False, [{"role": "user", "content": "higher"}]),
        ("5", False, [{"role": "user", "content": "x"}]),
    ]
    assert play(tok, PLAIN, None, turns).whole_tokenized == 2
    # an added token that takes the spaces before it is no split: what it matches depends on them
    tok.add_tokens([AddedToken("<sep>", lstrip=True, normalized=False)])
    assert "<sep>" not in split_tokens(tok) and "<|im_start|>" in split_tokens(tok)
    with_sep = PLAIN.replace("\n{% endfor %}", " <sep>{% endfor %}")
    assert with_sep != PLAIN
    assert play(tok, with_sep, None, turns).whole_tokenized == 2


def test_a_turn_of_many_chats_gives_each_the_ids_it_gets_alone():
    tok = build_bpe_tokenizer()
    eos = tok.convert_tokens_to_ids(IM_END)
    firsts = [USER, [{"role": "system", "content": "be brief"}, *USER], USER, USER]
    # per turn, each chat's (reply, engine stopped, observation); chats 2 and 3 alike (their texts shared)
    turns = [
        [("3 then", True, [{"role": "user", "content": "higher"}]), (" 5 ", False, [{"role": "tool", "content": "2"}]),
         ("4é", True, [{"role": "user", "content": "lower"}]), ("4é", True, [{"role": "user", "content": "lower"}])],
        [("6", False, [{"role": "user", "content": "yes"}]), ("x <|im_start|>", True, [{"role": "user", "content": " 4?"}]),
         ("2", True, [{"role": "tool", "content": "3"}, {"role": "tool", "content": " 4"}]), ("7", True, [])],
    ]  # fmt: skip
    for template, tools, whole_turns in ((tok.chat_template, None, 0), (QWEN_STYLE, TOOLS, 0), (PLAIN, None, 2)):
        chats = Conversation.start_all(tok, template, "t", firsts, tools)
        alone = [Conversation(tok, template, "t", first, tools) for first in firsts]
        assert [c.prompt_ids for c in chats] == [c.prompt_ids for c in alone]
        streams, messages = [list(c.prompt_ids) for c in chats], [list(first) for first in firsts]
        for turn in turns:
            # PLAIN has no stop token of its own: its replies are cut
            stop = [[eos] if stopped and template != PLAIN else [] for _, stopped, _ in turn]
            generated = [tok.encode(r, add_special_tokens=False) + s for (r, _, _), s in zip(turn, stop)]
            replies, observations = [r for r, _, _ in turn], [o for _, _, o in turn]
            extras = extend_all(chats, generated, replies, observations)
            assert extras == [c.extend(*args) for c, *args in zip(alone, generated, replies, observations)]
            for k, (reply, _, observation) in enumerate(turn):
                streams[k] += generated[k] + extras[k]
                messages[k] += [{"role": "assistant", "content": reply}, *observation]
                want = tok.apply_chat_template(
                    messages[k], chat_template=template, tools=tools, add_generation_prompt=True
                )
                assert streams[k] == list(want["input_ids"])
        assert [c.whole_tokenized for c in chats] == [whole_turns] * len(chats)
    assert extend_all([], [], [], []) == []
    # chats of different templates: each on its own
    mixed = [Conversation(tok, t, "t", USER) for t in (tok.chat_template, PLAIN)]
    alone = [Conversation(tok, t, "t", USER) for t in (tok.chat_template, PLAIN)]
    args = [[[5]] * 2, ["5"] * 2, [[{"role": "user", "content": "higher"}]] * 2]
    assert extend_all(mixed, *args) == [c.extend(*a) for c, *a in zip(alone, *args)]


def test_the_loss_mask_skips_observation_tokens_and_single_turn_is_unchanged():
    batch = RolloutBatch(
        [[5, 6], [7]], [[1, 2, 3], [4, 5]], [[-1.0] * 3, [-1.0] * 2], torch.zeros(2), torch.zeros(2), 1
    )
    _, _, single = batch.to_padded(0)
    assert single.tolist() == [[0, 1, 1, 1], [1, 1, 0, 0]]  # every response token (logits at t predict t+1)
    batch.loss_masks = [[1, 0, 1], [0, 1]]
    _, _, multi = batch.to_padded(0)
    assert multi.tolist() == [[0, 1, 0, 1], [0, 1, 0, 0]]
    assert batch.slice(1, 2).loss_masks == [[0, 1]]


def test_the_guess_environment_answers_and_rewards_fewer_turns():
    env = GuessEnv()
    assert env.reset(as_row({"prompt": "guess 1-8", "answer": "6"}).with_seed(1)) == USER
    assert env.step("3") == ([{"role": "user", "content": "higher"}], 0.0, False)
    assert env.step("no digit") == ([{"role": "user", "content": "a digit"}], 0.0, False)
    assert env.step("7") == ([{"role": "user", "content": "lower"}], 0.0, False)
    assert env.step("6") == ([], 0.25, True)


class NoStep:
    def reset(self, row):
        return USER


def test_the_env_is_checked_at_submit():
    with pytest.raises(ConfigError, match="rollout.env = 'nowhere:Env' cannot be imported"):
        resolve_env("nowhere:Env")
    with pytest.raises(ConfigError, match="has no step method"):
        resolve_env(f"{__name__}:NoStep")
    with pytest.raises(ConfigError, match="char tokenizer has none"):
        load_config(None, ["model.tiny={}", "data.task=guess", "rollout.max_episode_tokens=64"])
    with pytest.raises(ConfigError, match="rollout.max_episode_tokens = 256 .* exceeds the model's context length"):
        load_config(None, ["model.tiny.tokenizer=bpe", "data.task=guess"])
    with pytest.raises(ConfigError, match="rollout.max_turns = 0 must be >= 1"):
        load_config(None, ["model.tiny.tokenizer=bpe", "rollout.max_turns=0"])
    load_config(None, ["model.tiny.tokenizer=bpe", "data.task=guess", "rollout.max_episode_tokens=64"])


def test_episodes_through_a_cpu_engine_train_the_engines_tokens(tmp_path):
    """A rollout of guess episodes on an in-process CPU engine: every request sends the episode's
    tokens so far unchanged, the tokens masked 1 are exactly the engine's answers in order, the
    rest are the template's, and the dump holds the masks and turns."""
    from transformers import AutoTokenizer

    from rlhpc.engine_server.cpu.runner import Engine

    model = build_tiny_model(tmp_path / "tiny", TinyModelConfig(tokenizer="bpe"))
    cfg = load_config(
        None,
        [f"model.path={model}", "data.task=guess", "rollout.max_episode_tokens=40", "rollout.max_turns=3",
         "rollout.max_new_tokens=6", "rollout.n_samples_per_prompt=2"],
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(model)
    engine = Engine(str(model), "default")
    sent: list[list[int]] = []
    answers: list[list[int]] = []

    def answered(request, outputs):
        sent.extend(request.input_ids)
        answers.extend(list(o["output_ids"]) for o in outputs)

    send = in_process_send(engine, answered)

    episodes = make_episodes(cfg, tok)
    gen = Generation(tok, lambda *a: 0.0, cfg.rollout, cfg.eval, cfg.algo, cfg.seed, send, episodes=episodes)
    rows = [{"prompt": "guess 1-8", "answer": str(a)} for a in (2, 7)]
    batch, metrics, texts = gen.rollout(0, rows, None)

    assert len(batch) == 4 and {"episode/turns", "episode/truncated", "episode/observation_tokens"} <= set(metrics)
    for k in range(len(batch)):
        prompt, response, mask = batch.prompt_ids[k], batch.response_ids[k], batch.loss_masks[k]
        assert len(mask) == len(response) == len(batch.turns[k]) == len(batch.rollout_logprobs[k])
        # the episode's requests: its first is the k-th sent; each next one extends the one before
        # by the engine's answer exactly as returned (token-in/token-out), then the template's tokens
        chain = [k]
        for i in range(len(batch), len(sent)):
            ids, last = sent[i], chain[-1]
            if ids[: len(sent[last]) + len(answers[last])] == sent[last] + answers[last]:
                between = ids[len(sent[last]) + len(answers[last]) :]
                assert between and tok.decode(between).endswith("<|im_start|>assistant\n")
                chain.append(i)
        assert len(chain) == len(set(batch.turns[k]))
        generated = [t for t, m in zip(response, mask) if m]
        assert generated == [t for i in chain for t in answers[i]]  # the engine's tokens, in order
        assert (prompt + response)[: len(sent[chain[-1]])] == sent[chain[-1]]
        assert all(lp == 0.0 for lp, m in zip(batch.rollout_logprobs[k], mask) if not m)
    # the dump holds the per-token data
    write_rollout_dump(tmp_path / "r.h5", 0, batch, texts)
    with h5py.File(tmp_path / "r.h5") as f:
        assert [list(m) for m in f["loss_mask"][:]] == batch.loss_masks
        assert [list(t) for t in f["turn"][:]] == batch.turns
        assert list(f["truncated"][:]) == batch.truncated
