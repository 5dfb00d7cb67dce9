"""rlhpc-show-rollout on a dump from anyone (issue 43, item 10): a planted file makes HDF5 read no
other file, allocates no more than the file holds, and puts no control character on the terminal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhpc.batch import RolloutBatch
from rlhpc.cli import show_rollout
from rlhpc.devtools.attacks import ESCAPES, plant_dumps
from rlhpc.metrics import printable, write_rollout_dump

SECRET = "the reader's own secret, 0600"


def terminal_safe(text: str) -> bool:
    return all(c.isprintable() for c in text.replace("\n", ""))


def test_a_runs_own_dump_shows_with_its_texts_escaped(tmp_path, capsys):
    batch = RolloutBatch([[1, 2]], [[3]], [[-0.5]], torch.ones(1), torch.zeros(1), 1)
    write_rollout_dump(
        tmp_path / "r.h5", 7, batch, {"prompt": [f"2+2={ESCAPES}"], "response": ["4\n"], "answer": ["4"]}
    )
    assert show_rollout.main([str(tmp_path / "r.h5")]) == 0
    out = capsys.readouterr().out
    assert "rollout 7, 1 samples" in out and "\\x1b" in out and terminal_safe(out), out


@pytest.fixture
def planted(tmp_path: Path) -> dict[str, Path]:
    secret = tmp_path / "secret"
    secret.write_text(SECRET.ljust(64))
    secret.chmod(0o600)
    return plant_dumps(tmp_path, secret)


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("external", "/prompt is an external dataset"),
        ("virtual", "/rewards is a virtual dataset"),
        ("link", "/rewards is a link (ExternalLink)"),
        ("declared", "/rewards declares 400000000 bytes in a file of"),
        ("compressed", "/rewards has filters"),
    ],
)
def test_a_planted_dump_is_refused_before_hdf5_reads_another_file_or_allocates(planted, capsys, kind, why):
    assert planted[kind].stat().st_size < 1 << 20  # a few KB
    assert show_rollout.main([str(planted[kind])]) == 1
    said = capsys.readouterr()
    assert why in said.err and "not a rollout dump rlhpc can read safely" in said.err, said.err
    assert SECRET not in said.out + said.err and "42" not in said.out


def test_a_planted_dumps_texts_and_attributes_are_printed_escaped(planted, capsys):
    assert show_rollout.main([str(planted["escapes"])]) == 0
    out = capsys.readouterr().out
    assert f"rollout {printable(ESCAPES)}," in out and terminal_safe(out), out
