"""A user's data files: JSONL, JSON, Parquet, or a directory written by ``datasets.save_to_disk``,
read on the driver (and once at submit, to refuse a bad file before anything is queued).

``prompt_key`` and ``label_key`` may be dotted for nested fields (verl's files keep the label at
``reward_model.ground_truth``). Each row is a ``rlhpc.data.rows.Row``: the file's row as it is,
with its label and prompt messages as attributes (``rlhpc.data.prompts`` renders the messages
with the model's template); every error names the file, the row, the key and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhpc.data.images import check_placeholders, read_images
from rlhpc.data.rows import Row
from rlhpc.errors import ConfigError

FORMATS = ".jsonl, .json, .parquet, or a directory written by datasets.save_to_disk"
_MISSING = object()


def read_rows(
    path: str | Path, prompt_key: str = "prompt", label_key: str = "answer", image_key: str = "images"
) -> list[Row]:
    """The rows of ``path``, in the file's order, each with its prompt and label found, and its
    images (``image_key``, verl's ``images`` column: ``rlhpc.data.images``) where it has any."""
    path = Path(path)
    raw = _read(path)
    if not raw:
        raise ConfigError(f"{path} holds no rows", f"add rows with {prompt_key!r} and {label_key!r}")
    rows = []
    for number, row in raw:
        if not isinstance(row, dict):
            raise ConfigError(f"{path} {number} is a {type(row).__name__}, not an object", "write one object per row")
        prompt, label = _get(row, prompt_key), _get(row, label_key)
        for key, value in ((prompt_key, prompt), (label_key, label)):
            if value is _MISSING:
                raise ConfigError(
                    f"{path} {number} has no {key!r} (its keys: {', '.join(map(repr, row)) or 'none'})",
                    f"set data.prompt_key / data.label_key to where the prompt and label are "
                    f"(dotted for nested fields, e.g. reward_model.ground_truth), or add {key!r}",
                )
        if not isinstance(prompt, str) and not _is_chat(prompt):
            raise ConfigError(
                f"{path} {number}: {prompt_key!r} is {json.dumps(prompt, default=str)[:80]}, "
                "neither a text nor a list of chat messages",
                'give each row its prompt as text or as [{"role": "user", "content": "..."}, ...]',
            )
        if isinstance(label, dict | list) or label is None:
            raise ConfigError(
                f"{path} {number}: {label_key!r} is {json.dumps(label)[:80]}, not a text or number",
                "point data.label_key at the label itself (dotted for nested fields)",
            )
        images = _get(row, image_key)
        refs = read_images(images, path, number, image_key) if images not in (_MISSING, None, []) else []
        if refs and _is_chat(prompt):
            check_placeholders(prompt, refs, f"{path} {number}", image_key)
        rows.append(Row(row, prompt, str(label), refs))
    return rows


def check_exist(files: list[tuple[str, str, str, str]]) -> None:
    """Each of ``files`` ((key, file, prompt key, label key), as ``rlhpc.config.data_files`` lists
    them) exists."""
    for key, f, _, _ in files:
        if not Path(f).exists():
            raise ConfigError(f"{key} {f} does not exist", f"create it ({FORMATS}) or unset {key}")


def check_rows(files: list[tuple[str, str, str, str]], chat_template: str, image_key: str = "images") -> None:
    """Each file reads, at submit rather than after the queue wait (its images too); chat prompts have a template."""
    for _, f, prompt_key, label_key in files:
        rows = read_rows(f, prompt_key, label_key, image_key)
        if chat_template == "none" and any(r.is_chat for r in rows):
            raise ConfigError(
                f"{f} has chat-message prompts but data.chat_template is none",
                "set data.chat_template: auto (the tokenizer's template) or a Jinja file",
            )


def _is_chat(prompt: Any) -> bool:
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    )


def _get(row: dict, dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _read(path: Path) -> list[tuple[str, Any]]:
    """(where, row) pairs: "line N" of a JSONL file, "row N" of the others."""
    if path.is_dir():
        return _numbered(_from_disk(path))
    if not path.is_file():
        raise ConfigError(f"{path} does not exist", f"create it ({FORMATS}) or unset it")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl(path)
    if suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            # JSON Lines under a .json name is common: read it as such before giving up.
            if e.msg == "Extra data":
                return _jsonl(path)
            raise ConfigError(f"{path} is not valid JSON ({e})", "write a JSON list of objects, or JSONL") from e
        if not isinstance(data, list):
            raise ConfigError(
                f"{path} holds a {type(data).__name__}, not a list of rows", "write a JSON list of objects"
            )
        return _numbered(data)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return _numbered(pq.read_table(path).to_pylist())
        except Exception as e:  # pyarrow's errors have no common base worth naming
            raise ConfigError(f"{path} cannot be read as Parquet ({e})", "write it with pyarrow or datasets") from e
    raise ConfigError(f"{path} has the suffix {suffix or '(none)'!r}, which rlhpc does not read", f"give {FORMATS}")


def _numbered(rows: list) -> list[tuple[str, Any]]:
    return [(f"row {i}", row) for i, row in enumerate(rows)]


def _jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"{path} line {lineno} is not valid JSON ({e.msg})", "write one JSON object per line"
                ) from e
    return rows


def _from_disk(path: Path) -> list:
    import datasets  # late: a second of start-up, only for this format

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise ConfigError(
            f"{path} is a directory but not one datasets.save_to_disk wrote ({e})", f"give {FORMATS}"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        raise ConfigError(
            f"{path} holds the splits {', '.join(ds)}, not one dataset",
            f"point at one split's directory, e.g. {path / next(iter(ds))}",
        )
    return ds.to_list()
