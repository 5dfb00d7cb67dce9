"""tools/gpu_check.py rehearsed on the CPU (``--cpu``): the script a GPU session runs, kept working
between the sessions that have a GPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
if torch.cuda.is_available():
    pytest.skip("a CUDA device is present: tools/gpu_check.sh runs the check itself", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check.py"


def test_gpu_check_rehearsal(tmp_path):
    small = ["--rollouts", "2", "--prompts", "4", "--samples", "2", "--hidden", "128", "--layers", "1"]
    r = subprocess.run(
        [sys.executable, str(TOOL), "--cpu", *small, "--push-turns", "2", "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    assert "OK: engine weights == actor weights" in r.stdout
    figures = json.loads(r.stdout.strip().splitlines()[-1])  # the last line: the figures to compare runs by
    phases = ["engine_up", "weight_channel", "first_push", "first_rollout"]
    times = [figures[f"startup_{p}_s"] for p in phases]
    assert times == sorted(times), times  # each phase ends after the one it needs
    assert figures["startup_actor_up_s"] <= figures["startup_weight_channel_s"]
    assert 0 < figures["save_blocked_s"] <= figures["save_s"]
    assert figures["push_s"] > 0 and figures["d2d_copy_s"] > 0
    assert figures["actor_estimate_gib"] is None and figures["actor_peak_gib"] is None  # measured on a GPU only


def test_gpu_memory_check_rehearsal(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_memory_check.py"), "--cpu", "--work", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    rows = figures["rows"]
    assert [(x["tokens"], x["recompute"]) for x in rows] == [(64, False), (128, False), (64, True), (128, True)]
    for x in rows:  # the estimate is the dry run's, with its terms; the allocator's share leaves the runtime out
        assert abs(sum(x["terms_gib"].values()) - x["estimate_gib"]) < 0.01 and x["peak_gib"] is None
        assert x["allocator_estimate_gib"] < x["estimate_gib"]
    assert "activations (recompute)" in rows[2]["terms_gib"] and "activations (no recompute)" in rows[0]["terms_gib"]


def test_gpu_check_sh_names_files_that_exist():
    """A GPU session runs tools/gpu_check.sh as it is, with minutes to spare: every file of the
    repo it names must be there (it named tests/test_engine_cuda.py for days after the tests
    moved under tests/integration/, and would have stopped before the check)."""
    named = re.findall(r"(?<![\w/])((?:tests|tools)/[\w/.-]+\.py)", TOOL.with_suffix(".sh").read_text())
    assert "tests/integration/test_engine_cuda.py" in named and TOOL.relative_to(ROOT).as_posix() in named
    assert "tools/gpu_memory_check.py" in named
    assert [p for p in named if not (ROOT / p).is_file()] == []
