"""The tiny vision-language model for tests, and transformers' own processor of it as the reference."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from PIL import Image

from rlhpc.config import TinyModelConfig
from rlhpc.data.images import Vision
from rlhpc.model import build_tiny_model, load_tokenizer

TINY_VLM = TinyModelConfig(architecture="qwen2_5_vl", tokenizer="bpe")


def build_vlm(out: Path) -> Path:
    return build_tiny_model(out, TINY_VLM)


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def processor(vlm: Path) -> Any:
    """transformers' own Qwen2.5-VL processor of the model's image processor and tokenizer.
    (Its video processor needs torchvision, which this machine has not: images only.)"""
    from transformers import Qwen2_5_VLProcessor

    class ImagesOnly(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    return ImagesOnly(Vision(vlm).processor, load_tokenizer(vlm))
