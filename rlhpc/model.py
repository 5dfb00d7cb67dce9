"""The model in Hugging Face format: tiny Llama/Qwen2/Qwen3/Qwen3-MoE builds with a character-level tokenizer
(with a BOS) or a byte-level BPE shaped as Qwen's (no BOS, ChatML tokens and chat template), and a
tiny Qwen2.5-VL (a vision tower, Qwen's vision tokens, an image processor and a chat template that
writes them) to run images in prompts on a laptop.

Everything downstream (actor, engines, checkpoints) reads and writes a plain HF directory
(config.json + model.safetensors + tokenizer.json), so a real model drops in unchanged.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from rlhpc.config import TinyModelConfig  # a config section (torch-free); re-exported here
from rlhpc.data.images import is_vision_model
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


# Qwen-VL's vision tokens, added to the BPE for the tiny vision-language model.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
# The ChatML template with image parts written as Qwen-VL's template writes them: a message's
# content is its text, or a list of {"type": "image"} and {"type": "text", "text": ...} parts.
CHATML_VL_TEMPLATE = CHATML_TEMPLATE.replace(
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}",
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}",
)
# The tiny VLM's images: between 56x56 and 112x112 pixels after resizing (4 to 16 image tokens).
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 56 * 56, 112 * 112


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
    if cfg.architecture == "qwen2_5_vl":
        return _build_tiny_vlm(out, cfg)
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


def _build_tiny_vlm(out: Path, cfg: TinyModelConfig) -> Path:
    """A tiny random Qwen2.5-VL: the BPE with Qwen's vision tokens, a two-block vision tower, and
    beside it the image processor (PIL) and a chat template that writes the image tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = build_bpe_tokenizer(cfg.seed)
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]})
    tok.chat_template = CHATML_VL_TEMPLATE
    # mrope's (temporal, height, width) split of a head's rotary half, as Qwen's 16/24/24 of 64
    half = cfg.hidden_size // cfg.num_attention_heads // 2
    spatial = (half - half // 4) // 2
    hf_config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [half - 2 * spatial, spatial, spatial],
            },
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=cfg.hidden_size,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=tok.convert_tokens_to_ids(IMAGE_PAD),
        video_token_id=tok.convert_tokens_to_ids(VIDEO_PAD),
        vision_start_token_id=tok.convert_tokens_to_ids(VISION_START),
        vision_end_token_id=tok.convert_tokens_to_ids(VISION_END),
        tie_word_embeddings=False,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen2_5_VLForConditionalGeneration(hf_config).to(torch.float32)
    processor = Qwen2VLImageProcessorPil(
        min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    tmp.rename(out)
    log.info("built tiny qwen2_5_vl model (%d params) in %s", model.num_parameters(), out)
    return out


def load_model(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The causal LM at ``path`` (a vision-language model's ``*ForConditionalGeneration`` with its vision tower)."""
    auto = AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM
    model = auto.from_pretrained(str(path), dtype=torch.float32)
    return model.to(device)


def is_vision_language(path: str | Path) -> bool:
    """Whether the model at ``path`` takes images (``rlhpc.data.images.is_vision_model``)."""
    return is_vision_model(path)


def text_config(config: Any) -> Any:
    """The language model's part of a config (a vision-language model's ``text_config``; itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def mrope_positions(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor | None,
    grid_thw: torch.Tensor | None,
    images: torch.Tensor | None = None,
) -> torch.Tensor:
    """A Qwen-VL model's 3-D rotary positions [3, N, L] of ``ids`` (padding: 0 where ``attention``
    is), its images' ``grid_thw`` in order: the model's own ``get_rope_index``, given every input
    it needs (a forward that computes them itself falls back to 1-D positions when one is
    missing). ``images``: [N, L] where the image tokens are (default: every image token id; a
    response's are text: a policy may sample the token, which is then no image)."""
    types = (ids == model.config.image_token_id) if images is None else images
    positions, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=types.int(), image_grid_thw=grid_thw if grid_thw is not None and len(grid_thw) else None,
        attention_mask=attention,
    )  # fmt: skip
    return positions


def vision_language_logits(
    model: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor,
    attention: torch.Tensor | None,
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    images: torch.Tensor,
) -> torch.Tensor:
    """A Qwen-VL model's logits with its images' features at the ``images`` positions only (the
    prompts' image tokens): ``transformers``' forward puts them at every image token, and
    refuses a sequence whose response holds one the policy sampled; SGLang embeds such a token
    as text, and so does this. Otherwise the same computation (tested against it)."""
    inner = model.model
    embeds = inner.get_input_embeddings()(ids)
    features = torch.cat(inner.get_image_features(pixel_values, grid_thw, return_dict=True).pooler_output)
    embeds = embeds.masked_scatter(images[..., None].to(embeds.device), features.to(embeds.dtype))
    out = inner.language_model(inputs_embeds=embeds, position_ids=positions, attention_mask=attention, use_cache=False)
    return model.lm_head(out.last_hidden_state)


def is_classifier(path: str | Path) -> bool:
    """Whether the HF model at ``path`` is a sequence classifier (a reward model), by its config."""
    architectures = getattr(AutoConfig.from_pretrained(str(path)), "architectures", None) or []
    return any(a.endswith("ForSequenceClassification") for a in architectures)


def load_classifier(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32)
    return model.to(device)


def context_length(path: str | Path) -> int | None:
    """The model's context length from its config.json (``max_position_embeddings``), if it says."""
    n = getattr(text_config(AutoConfig.from_pretrained(str(path))), "max_position_embeddings", None)
    return int(n) if n else None


def routing_shape(path: str | Path) -> tuple[int, int, int]:
    """A MoE model's (layers, experts per token, experts) from its config.json: the shape of
    each token's routing (``RolloutBatch.routed_experts``)."""
    cfg = text_config(AutoConfig.from_pretrained(str(path)))
    return int(cfg.num_hidden_layers), int(cfg.num_experts_per_tok), int(cfg.num_experts)


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def weight_bytes(path: str | Path) -> int:
    """The size of a model directory's weight files (what an engine loads at start)."""
    return sum(f.stat().st_size for pattern in WEIGHT_FILES for f in Path(path).glob(pattern) if f.is_file())


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(path))
