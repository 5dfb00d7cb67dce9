"""Chat templates of the shapes the major model families ship, each written here from the
behaviour it must have (not copied from a model's files: no hub access, and the details that
matter are what rlhpc must handle), and a small byte-level BPE tokenizer for each, with that
family's special tokens and BOS behaviour. The tests render with them through rlhpc's own paths
and compare with ``transformers``' ``apply_chat_template``.

- ``QWEN25``: ChatML; a default system message when there is none, the tools listed in the
  system turn, consecutive tool answers gathered in one user turn; no BOS.
- ``QWEN3``: ChatML with reasoning: an assistant turn's ``<think>...</think>`` is kept only for
  turns after the last user message (a tool answer is no user message), and stripped from
  earlier ones; the turn in progress starts with an empty think block when it has none.
- ``LLAMA3``: writes its own BOS; header tokens around each role, contents trimmed, turns ended
  by ``<|eot_id|>``; its tokenizer also adds BOS to any text it encodes.
- ``GEMMA``: writes its own BOS; the assistant is the ``model`` role, the system message goes
  into the first user turn; its tokenizer adds BOS too.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

QWEN25 = (
    "{% if messages[0].role == 'system' %}{% set sys_text = messages[0].content %}{% set turns = messages[1:] %}"
    "{% else %}{% set sys_text = 'You are a helpful assistant.' %}{% set turns = messages %}{% endif %}"
    "<|im_start|>system\n{{ sys_text }}"
    "{% if tools %}{{ '\\n' }}\n# Tools\n\nYou may call functions. Their signatures:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    'Answer a call as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call>{% endif %}'
    "<|im_end|>\n"
    "{% for m in turns %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or turns[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or turns[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN3 = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'assistant' %}"
    "{% set answer = m.content %}{% set thought = '' %}"
    "{% if '</think>' in m.content %}"
    "{% set thought = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set answer = m.content.split('</think>')[-1].lstrip('\\n') %}"
    "{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user and (loop.last or thought) %}<think>\n{{ thought }}\n</think>\n\n{% endif %}"
    "{{ answer }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

GEMMA = (
    "{{ bos_token }}"
    "{% if messages[0].role == 'system' %}{% set first = messages[0].content + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ first if loop.first else '' }}{{ m.content }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    specials: tuple[str, ...]
    eos: str  # what the engine stops at (the end of an assistant turn)
    bos: str | None  # written by the template, and added by the tokenizer to what it encodes
    pad: str


FAMILIES = {
    "qwen2.5": Family("qwen2.5", QWEN25, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>", None, "<|endoftext|>"),
    "qwen3": Family("qwen3", QWEN3, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>", None, "<|endoftext|>"),
    "llama3": Family(
        "llama3", LLAMA3,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|eot_id|>", "<|begin_of_text|>", "<|end_of_text|>",
    ),
    "gemma": Family("gemma", GEMMA, ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<end_of_turn>", "<bos>", "<pad>"),
}  # fmt: skip

CORPUS = [
    "guess a number from 1 to 8", "higher", "lower", "yes, that is it", "3 then", "the answer is 7",
    "You are a helpful assistant.", "<think>\nsmall steps\n</think>", "<tool_call>", "</tool_call>",
    '{"name": "add", "arguments": {"a": 1, "b": 2}}', "<tool_response>", "</tool_response>", "é ü ß 4é",
]  # fmt: skip


def tokenizer(family: Family) -> PreTrainedTokenizerFast:
    """A small byte-level BPE with ``family``'s special tokens, EOS, pad and chat template; where
    the family has a BOS, the tokenizer adds it to every encoding (as Llama 3's and Gemma's do)."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(family.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS * 3, trainer)
    if family.bos is not None:
        bos = core.token_to_id(family.bos)
        core.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", special_tokens=[(family.bos, bos)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        chat_template=family.template,
    )
