"""What a run that was interrupted, killed or refused along the way must still be at its end.

``violations(run, reference)`` names every way a finished run differs from what an undisturbed
run of the same config (``reference``) promises: every rollout and evaluation logged exactly
once, ``latest`` valid and at the last rollout, the final weights and every per-rollout metric
identical (a deterministic run), nothing left behind (staging directories, the run dir still
claimed, a job process still alive, a local job's Ray temp dir). ``tools/chaos.py`` and the tests share it.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from rlhpc.checkpoint import LATEST, STAGING, CheckpointManager, validate
from rlhpc.errors import RlhpcError
from rlhpc.metrics import read_metrics
from rlhpc.run_dir import RunDir

# Metrics of how a run was served, not of what it computed: timings, and the engine count (fewer
# after an engine node is lost, while the results stay the same).
HOW_SERVED = ("time/", "rollout/num_engines")


def comparable(run: RunDir | str | Path) -> list[dict]:
    """A run's metrics without timings and engine counts: what must equal an undisturbed run's."""
    return [{k: v for k, v in r.items() if not k.startswith(HOW_SERVED)} for r in read_metrics(run)]


def final_weights(run: RunDir | str | Path) -> bytes:
    """The newest checkpoint's weights, byte for byte."""
    ck = CheckpointManager(RunDir.of(run).checkpoints, 2).latest()
    if ck is None:
        raise RlhpcError(f"{run} has no valid checkpoint", "run it to the end first")
    return (ck.path / "actor" / "model.safetensors").read_bytes()


def processes_using(path: Path) -> list[str]:
    """Live processes whose command line names ``path`` (a job's task, engines, Ray workers)."""
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state != "Z" and str(path) in args:
            found.append(f"pid {entry.name}: {args[:160]}")
    return found


def _logged_once(kind: str, ids: list[int], expected: list[int]) -> list[str]:
    problems = []
    twice = sorted(i for i, n in Counter(ids).items() if n > 1)
    if twice:
        problems.append(f"{kind} logged more than once: {twice}")
    missing = sorted(set(expected) - set(ids))
    if missing:
        problems.append(f"{kind} never logged: {missing}")
    extra = sorted(set(ids) - set(expected))
    if extra:
        problems.append(f"{kind} logged that the undisturbed run has not: {extra}")
    return problems


def violations(run: RunDir | str | Path, reference: RunDir | str | Path) -> list[str]:
    """Every way ``run`` falls short of ``reference`` (an undisturbed run of its config); [] if none."""
    run, reference = RunDir.of(run), RunDir.of(reference)
    problems: list[str] = []
    if not run.is_finished():
        problems.append("not finished (no FINISHED file)")
    try:
        records, want = read_metrics(run), read_metrics(reference)
    except RlhpcError as e:
        return [*problems, f"metrics unreadable: {e.problem}"]
    for kind in ("rollout", "eval"):
        problems += _logged_once(
            f"{kind}s",
            [r["rollout_id"] for r in records if r["kind"] == kind],
            [r["rollout_id"] for r in want if r["kind"] == kind],
        )

    latest = run.checkpoints / LATEST
    pointed = run.checkpoints / latest.read_text().strip() if latest.is_file() else None
    reason = validate(pointed) if pointed is not None else "missing"
    if reason is not None:
        problems.append(f"`latest` is not a valid checkpoint: {reason}")
    newest = CheckpointManager(run.checkpoints, 2).latest()
    want_last = CheckpointManager(reference.checkpoints, 2).latest()
    if newest is None or want_last is None or newest.rollout_id != want_last.rollout_id:
        problems.append(
            f"newest checkpoint is rollout {newest and newest.rollout_id}, not {want_last and want_last.rollout_id}"
        )
    elif pointed is not None and pointed.resolve() != newest.path.resolve():
        problems.append(f"`latest` names {pointed.name}, not the newest checkpoint {newest.path.name}")
    elif final_weights(run) != final_weights(reference):
        problems.append("final weights differ from the undisturbed run's")
    if not problems and comparable(run) != comparable(reference):
        diff = next(
            (f"{a}\n    vs {b}" for a, b in zip(comparable(run), comparable(reference)) if a != b), "lengths differ"
        )
        problems.append(f"per-rollout metrics differ from the undisturbed run's: first {diff}")

    debris = [p.name for p in run.checkpoints.glob(f"{STAGING}*")]
    debris += [p.name for p in run.checkpoints.glob(f".{LATEST}.tmp-*")]
    if debris:
        problems.append(f"debris in checkpoints/: {sorted(debris)}")
    if run.owner_file.exists():
        problems.append(f"the run dir is still claimed: {run.owner_file.read_text().strip()}")
    ray_temp = run.local_ray_dir
    if ray_temp is not None and ray_temp.exists():
        problems.append(f"Ray's temp dir of the run left behind: {ray_temp}")
    alive = processes_using(run.path)
    if alive:
        problems.append(f"processes left behind: {alive}")
    return problems
