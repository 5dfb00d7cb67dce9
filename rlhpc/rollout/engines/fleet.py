"""A shared engine fleet, as the runs attached to it read it: the fleet file.

A ``--shared-fleet`` sweep's owner (``rlhpc.launch.fleet``) starts the engines once and writes
this file; each run of the sweep (``rollout.fleet``) reads it instead of starting engines, and
serves its own adapter there under its own name (``adapter_name``). The engines belong to the
owner: a run neither restarts nor stops them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhpc.errors import RlhpcError
from rlhpc.util.files import write_atomic


@dataclass(frozen=True)
class FleetFile:
    engines: tuple[str, ...]  # each engine's URL
    logs: tuple[str, ...]  # each engine's log file
    key_file: str  # the fleet's engine key (rlhpc.wire.engine_key), sent on every call

    def write(self, path: Path) -> None:
        write_atomic(path, json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> FleetFile:
        try:
            d = json.loads(Path(path).read_text())
            return cls(tuple(d["engines"]), tuple(d["logs"]), str(d["key_file"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RlhpcError(
                f"rollout.fleet = {path}: no fleet file to attach to ({e})",
                "run the sweep with --shared-fleet (its owner writes the file while the fleet is up), "
                "or unset rollout.fleet to start the run's own engines",
            ) from None


def adapter_name(run_dir: Path) -> str:
    """The name a run's adapter is served under on a shared fleet: its run dir's (``task_000``),
    unique within the sweep."""
    return Path(run_dir).name
