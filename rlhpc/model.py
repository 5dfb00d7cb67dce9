"""The model in Hugging Face format: a character-level tokenizer and tiny Llama/Qwen2 builds.

Everything downstream (actor, engines, checkpoints) reads and writes a plain HF directory
(config.json + model.safetensors + tokenizer.json), so a real model drops in unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from rlhpc.config import TinyModelConfig  # a config section (torch-free); re-exported here

log = logging.getLogger(__name__)
# Per-shard progress bars from every Ray worker drown the driver's output.
hf_logging.disable_progress_bar()

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# One token per character: enough for arithmetic and string toy tasks.
CHARS = list("0123456789+-*=?:; ") + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, padding_side="left"
    )


def build_tiny_model(out_dir: str | Path, cfg: TinyModelConfig) -> Path:
    """Write a tiny random model + tokenizer to ``out_dir`` (deterministic in ``cfg.seed``)."""
    out = Path(out_dir)
    tok = build_char_tokenizer()
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
    )
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # a half-written model dir is never seen under its final name
    log.info("built tiny %s model (%d params) in %s", cfg.architecture, model.num_parameters(), out)
    return out


def load_model(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.to(device)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(path))
