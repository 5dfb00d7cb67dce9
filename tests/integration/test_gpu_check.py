"""tools/gpu_check.py rehearsed on the CPU (``--cpu``): the script a GPU session runs, kept working
between the sessions that have a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
if torch.cuda.is_available():
    pytest.skip("on a GPU machine tools/gpu_check.sh runs the check itself", allow_module_level=True)

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"


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
