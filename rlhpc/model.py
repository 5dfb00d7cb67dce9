"""The model in Hugging Face format: tiny Llama/Qwen2/Qwen3/Qwen3-MoE builds with a character-level tokenizer
(with a BOS) or a byte-level BPE shaped as Qwen's (no BOS, ChatML tokens and chat template).

Everything downstream (actor, engines, checkpoints) reads and writes a plain HF directory
(config.json + model.safetensors + tokenizer.json), so a real model drops in unchanged.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from rlhpc.config import TinyModelConfig  # a config section (torch-free); re-exported here
from rlhpc.data.tasks import TASKS

log = logging.getLogger(__name__)
# Per-shard progress bars from every Ray worker drown the driver's output.
hf_logging.disable_progress_bar()

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# One token per character: enough for arithmetic and string toy tasks.
CHARS = list("0123456789+-*=?:; ") + [chr(c) for c in range(ord("a"), ord("z") + 1)]


# The byte-level BPE's special tokens, named as ChatML (Qwen2/Qwen3) names them.
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
BPE_VOCAB_SIZE = 320  # the 256 bytes, the specials, and merges of the tasks' frequent pairs
BPE_TASKS = ("digit_sum", "reverse")  # the tasks whose text the BPE's merges are learned from
# A ChatML template (the shape Qwen's tokenizers ship), written for this tiny tokenizer.
# Tools (a request's or an episode's OpenAI schemas) are listed in a system turn of their own,
# with Qwen's instruction to answer in <tool_call> blocks; without tools nothing changes.
CHATML_TEMPLATE = (
    '{% if tools %}{{ \'<|im_start|>system\\n# Tools\\nCall a function by writing <tool_call>{"name": ..., '
    "\"arguments\": {...}}</tool_call>. The functions:\\n' }}{% for t in tools %}{{ t | tojson }}{{ '\\n' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% if messages[0]['role'] != 'system' and system_prompt is defined %}"
    "{{ '<|im_start|>system\\n' + system_prompt + '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; every encoding starts with BOS (its post-processor adds it, as
    Llama's does), so ``add_special_tokens=True`` gives what the model was built to read."""
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, padding_side="left"
    )


def build_bpe_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the built-in tasks' text, shaped as Qwen's: no BOS, EOS
    ``<|im_end|>``, pad ``<|endoftext|>``, a ChatML chat template, and a token for every byte
    (NUL and bytes that are not UTF-8 on their own among them)."""
    rng = random.Random(seed)
    # the first two tasks' text only: the vocabulary (and every tiny model built so far) stays as
    # it was when a task is added
    corpus = [f"{r['prompt']}{r['answer']}" for name in BPE_TASKS for r in TASKS[name].make(2000, rng)]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        padding_side="left",
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny_model(out_dir: str | Path, cfg: TinyModelConfig, classifier: bool = False) -> Path:
    """Write a tiny random model + tokenizer to ``out_dir`` (deterministic in ``cfg.seed``).
    ``classifier``: a one-label ``*ForSequenceClassification`` (a reward model) on the same
    tokenizer, instead of a causal LM."""
    out = Path(out_dir)
    tok = build_char_tokenizer() if cfg.tokenizer == "char" else build_bpe_tokenizer(cfg.seed)
    extra: dict[str, object] = {}
    if cfg.architecture in ("qwen3", "qwen3_moe"):
        # Qwen3's config defaults head_dim to 128 whatever the hidden size: derive it as the others do.
        extra["head_dim"] = cfg.hidden_size // cfg.num_attention_heads
    if cfg.architecture == "qwen3_moe":
        extra.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=True,  # as Qwen3-30B-A3B and 235B-A22B ship
        )
    hf_config = AutoConfig.for_model(
        cfg.architecture,
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        **extra,
        **({"num_labels": 1} if classifier else {}),  # a reward model's one score
    )
    torch.manual_seed(cfg.seed)
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    model = auto.from_config(hf_config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # a half-written model dir is never seen under its final name
    kind = "classifier" if classifier else "model"
    log.info("built tiny %s %s (%d params) in %s", cfg.architecture, kind, model.num_parameters(), out)
    return out


def load_model(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.to(device)


def is_classifier(path: str | Path) -> bool:
    """Whether the HF model at ``path`` is a sequence classifier (a reward model), by its config."""
    architectures = getattr(AutoConfig.from_pretrained(str(path)), "architectures", None) or []
    return any(a.endswith("ForSequenceClassification") for a in architectures)


def load_classifier(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32)
    return model.to(device)


def context_length(path: str | Path) -> int | None:
    """The model's context length from its config.json (``max_position_embeddings``), if it says."""
    n = getattr(AutoConfig.from_pretrained(str(path)), "max_position_embeddings", None)
    return int(n) if n else None


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def weight_bytes(path: str | Path) -> int:
    """The size of a model directory's weight files (what an engine loads at start)."""
    return sum(f.stat().st_size for pattern in WEIGHT_FILES for f in Path(path).glob(pattern) if f.is_file())


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(path))
