"""The tool journal: every tool call's answer in an episode, kept on disk as it is made, so that
an episode a stop or a crash cut is replayed with the answers it got (``rollout.tool_journal``,
``docs/guides/multi-turn.md#stops-engine-deaths-and-the-async-pipeline``).

A resumed job generates again the rollouts after its checkpoint, from the same seeds, and the
engines give the same tokens; a tool that reads the clock, the network or a sandbox's state
would answer differently the second time, and the episode, and the run, would go elsewhere.
So each call's answer is appended to ``RUN_DIR/tool_journal/<scope>.jsonl`` (one file per
generation: a rollout, a dynamic-sampling round, an evaluation), fsynced once per turn, before
the episode goes on. A later generation of the same scope (after a resume) answers a call from
the journal instead of running it when the call is the one recorded: the same episode, turn
and place in the reply, the same tool and the same arguments. Anything else runs the tool (and
is recorded in turn). A SIGKILL leaves no chance to save anything, so the journal is written as
the calls happen, beside the checkpoints, and not into one; files of rollouts no kept checkpoint
can go back to are removed (``prune``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlhpc.wire.tool_calls import ParsedCall

log = logging.getLogger(__name__)

_SCOPE = re.compile(r"^(?:rollout|eval)_(\d+)")


def arguments_key(arguments: str | dict) -> str:
    """A call's arguments in one canonical text: JSON text and a dict of the same values agree."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True)
class Recorded:
    """A call's answer as the journal holds it."""

    name: str
    arguments: str
    content: str
    error: bool = False
    timeout: bool = False
    infra: bool = False


class ScopeJournal:
    """One generation's journal: what an earlier generation of it recorded, and the file new
    answers are appended to."""

    def __init__(self, path: Path):
        self.path = path
        self.recorded: dict[tuple[int, int, int], Recorded] = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    e = json.loads(line)
                except ValueError:  # a line torn by a kill mid-write: its call runs again
                    continue
                self.recorded[(e["k"], e["t"], e["j"])] = Recorded(
                    e["name"], e["arguments"], e["content"], e["error"], e["timeout"], e["infra"]
                )
        self.replayed = 0
        self._file = None

    def lookup(self, episode: int, turn: int, index: int, call: ParsedCall) -> Recorded | None:
        """The recorded answer of call ``index`` of episode ``episode``'s reply in ``turn``, if
        that call was this one (same tool, same arguments)."""
        found = self.recorded.get((episode, turn, index))
        if found is None or found.name != call.name or found.arguments != arguments_key(call.arguments):
            return None
        self.replayed += 1
        return found

    def record(self, answers: Sequence[tuple[int, int, int, Recorded]]) -> None:
        """Append one turn's new answers ((episode, turn, index, answer) each), then fsync."""
        if not answers:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")  # noqa: SIM115 (open for the generation's length)
        for k, t, j, a in answers:
            line = {"k": k, "t": t, "j": j, "name": a.name, "arguments": a.arguments, "content": a.content}
            line.update(error=a.error, timeout=a.timeout, infra=a.infra)
            self._file.write(json.dumps(line, ensure_ascii=False) + "\n")
            self.recorded[(k, t, j)] = a
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.replayed:
            log.info("%s: %d tool call(s) answered from the journal", self.path.stem, self.replayed)


class ToolJournal:
    """The run's tool journal directory (``RunDir.tool_journal``)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def scope(self, name: str) -> ScopeJournal:
        return ScopeJournal(self.root / f"{name}.jsonl")

    def prune(self, before: int) -> None:
        """Remove the files of rollouts (and evaluations after rollouts) before ``before``: the
        oldest checkpoint kept, which no resume goes back past."""
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            found = _SCOPE.match(path.name)
            if found and int(found.group(1)) < before:
                path.unlink(missing_ok=True)

    def clear(self) -> None:
        """A run that starts over (``checkpoint.resume: never``): nothing recorded belongs to it."""
        shutil.rmtree(self.root, ignore_errors=True)


def scope_name(seed_tag: object, rollout_id: int | None = None) -> str:
    """A generation's journal file: ``rollout_000002`` for rollout 2 (``seed_tag`` 2), its
    dynamic-sampling round 1 (``"2/1"``) ``rollout_000002.r1``; an evaluation (``seed_tag`` its
    split, ``rollout_id`` the rollout it follows) ``eval_000002.eval-NAME``."""
    if isinstance(seed_tag, int):
        return f"rollout_{seed_tag:06d}"
    if rollout_id is None:
        rollout, _, rnd = str(seed_tag).partition("/")
        return f"rollout_{int(rollout):06d}.r{rnd}"
    return f"eval_{rollout_id:06d}.{re.sub(r'[^A-Za-z0-9_.-]', '-', str(seed_tag))}"
