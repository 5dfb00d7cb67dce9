"""The row contract: what environments, generate functions, agents and rewards get of a data row.

A ``Row`` is the file's row as it is: every column, nested as in the file (a dict: verl's
``row["reward_model"]["ground_truth"]``, ``row["extra_info"]["question"]``; a plain file's
``row["prompt"]``, ``row["answer"]``). What rlhpc derives from it is on attributes, which no
column can shadow or be mistaken for:

- ``label``: the label (``data.label_key``, dotted for nested fields), as text;
- ``messages``: the prompt as chat messages: the file's own list, or its text as one user
  message (``data.system_prompt`` is not in it: rlhpc adds it where it renders a chat);
- ``prompt_text``: the prompt as the model is given it: the messages rendered by the chat
  template (system prompt and generation prompt included), or the text as it is;
- ``episode_seed``: in an episode, an int that is a pure function of (run seed, rollout,
  sample), to seed the episode's own randomness from; None elsewhere;
- ``images``: the prompt's images (``rlhpc.data.images.ImageRef``, read from ``data.image_key``
  at load, checked to decode), in the order of the ``<image>`` marks in its messages; empty for
  a text-only row.

Rows are made once, at load (``rlhpc.data.files``, a task's generator), and never changed: a
derived form is set on a copy (``derive``).
"""

from __future__ import annotations

import copy
from typing import Any


class Row(dict):
    """One data row: the file's columns as dict items, rlhpc's forms as attributes (module doc)."""

    def __init__(self, columns: dict, prompt: str | list[dict], label: str, images: list | None = None):
        super().__init__(columns)
        self.label = label
        self.is_chat = not isinstance(prompt, str)  # the file gave the prompt as chat messages
        self.messages: list[dict] = list(prompt) if self.is_chat else [{"role": "user", "content": prompt}]
        self.prompt_text: str | None = None if self.is_chat else prompt  # a chat's: once rendered
        self.prompt_ids: list[int] | None = None  # a rendered chat's ids (apply_chat_template's)
        self.episode_seed: int | None = None
        self.images: list = list(images or [])  # rlhpc.data.images.ImageRef, in the prompt's order

    def derive(self, **attrs: Any) -> Row:
        """A copy with the attributes ``attrs`` set (the columns are shared: rows are read-only)."""
        out = copy.copy(self)
        for name, value in attrs.items():
            if name not in self.__dict__:
                raise AttributeError(f"a Row has no derived form {name!r}")
            setattr(out, name, value)
        return out

    def with_seed(self, episode_seed: int) -> Row:
        return self.derive(episode_seed=episode_seed)

    def __repr__(self) -> str:
        return f"Row({dict.__repr__(self)}, label={self.label!r})"


def as_row(row: dict) -> Row:
    """``row`` as a ``Row``: itself, or a plain ``{"prompt", "answer"}`` dict (code and tests that
    build rows by hand, a toy task's generator: with ``images``, its ``ImageRef``s) read as a file row."""
    if isinstance(row, Row):
        return row
    return Row(row, row["prompt"], str(row["answer"]), row.get("images"))


def as_rows(rows: list[dict]) -> list[Row]:
    return [as_row(r) for r in rows]


def describe(row: Row) -> str:
    """A row in one short line, for errors: its label and the end of its prompt."""
    prompt = row.prompt_text if row.prompt_text is not None else row.messages[-1].get("content", "")
    return f"the row with label {row.label[:40]!r} and prompt {str(prompt)[-80:]!r}"
