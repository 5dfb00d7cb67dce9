"""An image as it travels: in a data row, to the engines as SGLang's ``image_data`` (a data URI),
to the actor in a ``RolloutBatch``, into a checkpoint's pending rollouts and a rollout dump.
(Reading a data file's images, and a model's image processor: ``rlhpc.data.images``.)"""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhpc.errors import RlhpcError


@dataclass(frozen=True)
class ImageRef:
    """One image: ``source`` says where it came from (``FILE row N images[0]``, a path, a task),
    ``path`` or ``data`` (its encoded bytes: PNG, JPEG, ...) hold it. Small to pickle: a group's
    samples share the one object, and a rollout dump keeps the source, not the bytes, of an
    image that lives in a file. Equal by value (rows loaded twice compare equal); code that
    processes each image once keys on ``id`` (the shared object), not on its bytes."""

    source: str
    path: str | None = None
    data: bytes | None = field(default=None, repr=False)
    in_data_file: bool = False  # ``source`` is a data file's row: it finds the image again

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.path is not None
        try:
            return Path(self.path).read_bytes()
        except OSError as e:
            raise RlhpcError(
                f"the image {self.source} cannot be read ({e})", "restore the file, or drop the row"
            ) from e

    def open(self) -> Any:
        """The decoded image (PIL), RGB."""
        from PIL import Image

        with Image.open(io.BytesIO(self.read())) as img:
            return img.convert("RGB")

    def uri(self) -> str:
        """As SGLang's ``image_data`` takes it: a data URI of its bytes (no file access on the engine's node)."""
        data = self.read()
        kind = "png" if data[:8] == b"\x89PNG\r\n\x1a\n" else "jpeg" if data[:2] == b"\xff\xd8" else "png"
        return f"data:image/{kind};base64," + base64.b64encode(data).decode()

    @property
    def durable(self) -> bool:
        """Whether ``source`` finds the image again (a file, or a data file's row), so a dump need
        not keep its bytes."""
        return self.path is not None or self.in_data_file

    def digest(self) -> str:
        return hashlib.sha256(self.read()).hexdigest()[:32]

    def state(self) -> dict[str, Any]:
        """As plain values (a checkpoint's pending rollouts are loaded with ``weights_only``)."""
        return {"source": self.source, "path": self.path, "data": self.data, "in_data_file": self.in_data_file}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> ImageRef:
        return cls(d["source"], d["path"], d["data"], d["in_data_file"])


def from_png(source: str, image: Any) -> ImageRef:
    """A PIL image (generated: a toy task's, an environment's observation) as an ``ImageRef``."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return ImageRef(source, data=buf.getvalue())


def decode_uri(item: Any, where: str) -> ImageRef:
    """One entry of a /generate request's ``image_data`` (SGLang's ``load_image`` forms: a data
    URI, raw base64, a file path or ``file://`` URL) as an ``ImageRef``; URLs are refused (no network)."""
    if not isinstance(item, str):
        raise RlhpcError(f"{where} is a {type(item).__name__}", "send each image as a data URI, base64 or a path")
    if item.startswith(("http://", "https://")):
        raise RlhpcError(
            f"{where} is a URL, which the CPU engine does not fetch", "send the image's bytes as a data URI"
        )
    if item.startswith("file://"):
        return ImageRef(where, path=item[len("file://") :])
    if item.startswith("data:"):
        try:
            return ImageRef(where, data=base64.b64decode(item.split(",", 1)[1], validate=True))
        except (IndexError, ValueError) as e:
            raise RlhpcError(f"{where} is not a base64 data URI ({e})", "send data:image/png;base64,...") from e
    if Path(item).suffix.lower() in (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff"):
        return ImageRef(where, path=item)
    try:
        return ImageRef(where, data=base64.b64decode(item, validate=True))
    except ValueError as e:
        raise RlhpcError(f"{where} is neither a path nor base64 ({e})", "send data:image/png;base64,...") from e
