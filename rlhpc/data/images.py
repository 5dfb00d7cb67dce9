"""Images in prompts: a row's images, read and checked at load, and a vision-language model's
image processor (how many tokens an image takes, its pixels for a forward).

verl's layout, which rlhpc reads as it is: an ``images`` column (``data.image_key``) holding a
list of images per row (encoded bytes, a path, a ``{"bytes", "path"}`` dict as ``datasets``'
``Image`` feature writes it to Parquet, or a PIL image), and one ``<image>`` in the prompt
messages' text where each image goes, in order. Each image becomes an ``ImageRef``: where it
came from (for errors and rollout dumps) and how to read its bytes. At render time
(``rlhpc.data.prompts``) a message's ``<image>`` becomes an image part the chat template writes
its vision tokens for, and each image's one pad token is repeated as many times as the image
processor makes tokens of it: as ``transformers``' processors do, so the prompt's length counts
them.

``Vision`` is what rlhpc needs of a vision-language model: its image processor (the model
directory's ``preprocessor_config.json``, run with PIL: no torchvision needed) and its image
token. The driver uses it to count tokens, the engine and the actor to compute pixels, all
from the same file, so the three agree.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

from rlhpc.errors import ConfigError
from rlhpc.wire.images import ImageRef, decode_uri, from_png  # noqa: F401 - re-exported: the data side's names

PLACEHOLDER = "<image>"  # verl's (and SGLang's) mark of an image in a message's text


# ------------------------------------------------------------------ reading a row's images


def read_images(value: Any, file: Path, number: str, key: str) -> list[ImageRef]:
    """The images of one row's ``key`` column (one image or a list of them), each checked to
    decode; an error names the file, the row, the key and the image."""
    items = value if isinstance(value, list) else [value]
    refs = []
    for k, item in enumerate(items):
        where = f"{file} {number} {key}[{k}]"
        ref = _ref(item, file, where)
        _check(ref, where)
        refs.append(ref)
    return refs


def _ref(item: Any, file: Path, where: str) -> ImageRef:
    if isinstance(item, dict):  # datasets' Image feature in Parquet/JSON: {"bytes": ..., "path": ...}
        if item.get("bytes"):
            return ImageRef(where, data=bytes(item["bytes"]), in_data_file=True)
        item = item.get("path")
    if isinstance(item, bytes | bytearray):
        return ImageRef(where, data=bytes(item), in_data_file=True)
    if isinstance(item, str) and item:
        path = Path(item)
        if not path.is_absolute() and not path.exists():
            path = file.parent / path  # relative to the data file, as datasets writes them
        return ImageRef(where, path=str(path))
    if hasattr(item, "save") and hasattr(item, "mode"):  # a PIL image (a datasets Image column, decoded)
        return ImageRef(where, data=from_png(where, item).data, in_data_file=True)
    raise ConfigError(
        f"{where} is {json.dumps(item, default=str)[:80]}, not an image",
        "give each image as its bytes, a path, or a {'bytes': ..., 'path': ...} dict (datasets' Image feature)",
    )


def _check(ref: ImageRef, where: str) -> None:
    from PIL import Image, UnidentifiedImageError

    if ref.path is not None and not Path(ref.path).is_file():
        raise ConfigError(f"{where}: the image file {ref.path} does not exist", "fix the path, or drop the row")
    try:
        with Image.open(io.BytesIO(ref.read())) as img:
            img.verify()  # the header and the file's integrity, without decoding every pixel
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
        raise ConfigError(
            f"{where} is not an image PIL can read ({type(e).__name__}: {e})", "fix or drop the image, or the row"
        ) from e


def check_placeholders(messages: list[dict], images: list[ImageRef], where: str, key: str) -> None:
    """One ``<image>`` in the messages' text per image."""
    count = sum(m["content"].count(PLACEHOLDER) for m in messages if isinstance(m.get("content"), str))
    if count != len(images):
        raise ConfigError(
            f"{where} has {len(images)} image(s) in {key!r} but {count} {PLACEHOLDER} in its prompt messages",
            f"put one {PLACEHOLDER} in the messages' text where each image goes, in the order of {key!r}",
        )


def with_image_parts(messages: list[dict]) -> list[dict]:
    """Each message whose text holds ``<image>`` as a list of parts (``{"type": "image"}`` and
    ``{"type": "text", "text": ...}``), as vision chat templates (Qwen-VL's) take them; the
    others as they are."""
    out = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str) or PLACEHOLDER not in content:
            out.append(m)
            continue
        parts: list[dict] = []
        for k, piece in enumerate(content.split(PLACEHOLDER)):
            if k:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**m, "content": parts})
    return out


# ------------------------------------------------------------------ the model's processor


class Vision:
    """A vision-language model's image processor and image tokens, read from its directory."""

    def __init__(self, model_path: str | Path):
        from transformers import AutoConfig, AutoImageProcessor

        cfg = AutoConfig.from_pretrained(str(model_path))
        self.image_token_id = int(cfg.image_token_id)
        self.vision_start_id = getattr(cfg, "vision_start_token_id", None)
        self.merge = int(cfg.vision_config.spatial_merge_size)
        # PIL, not torchvision: the same pixels wherever it runs (and no torchvision on CPU machines)
        self.processor = AutoImageProcessor.from_pretrained(str(model_path), backend="pil")
        self._counts: dict[tuple[int, int], int] = {}

    def tokens(self, ref: ImageRef) -> int:
        """How many image tokens ``ref`` becomes (from its size alone: the header is read, not the pixels)."""
        from PIL import Image

        with Image.open(io.BytesIO(ref.read())) as img:
            width, height = img.size
        if (height, width) not in self._counts:
            patches = self.processor.get_number_of_image_patches(height, width, {})
            self._counts[(height, width)] = patches // self.merge**2
        return self._counts[(height, width)]

    def pixels(self, refs: list[ImageRef]) -> tuple[Any, Any]:
        """``(pixel_values, image_grid_thw)`` of ``refs``, in order, as the model's forward takes them."""
        out = self.processor(images=[r.open() for r in refs], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]


def load_vision(model_path: str | Path) -> Vision | None:
    """``Vision`` of the model at ``model_path``, or None for a text-only model."""
    if not is_vision_model(model_path):
        return None
    return Vision(model_path)


def is_vision_model(model_path: str | Path) -> bool:
    """Whether the model at ``model_path`` takes images (its config has a vision tower and an image token)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    raw = json.loads(config.read_text())
    return "vision_config" in raw and "image_token_id" in raw


def expand_pads(text: str, pad: str, counts: list[int], guard: str) -> str:
    """``text`` (a rendering) with its i-th ``pad`` (one the template wrote: not preceded by
    ``guard``, the mark of a pad that was the messages' own text) repeated ``counts[i]`` times."""
    found = list(re.finditer(f"(?<!{re.escape(guard)}){re.escape(pad)}", text))
    if len(found) != len(counts):
        raise ConfigError(
            f"the chat template wrote {len(found)} image placeholder(s) {pad!r} for {len(counts)} image(s)",
            "use the model's own chat template (data.chat_template: auto), which writes one per image part",
        )
    out, at = [], 0
    for m, n in zip(found, counts):
        out += [text[at : m.start()], pad * n]
        at = m.end()
    return "".join(out) + text[at:]
