"""The test tree itself: pytest imports every test module by its basename (no packages), so two
modules of one name in different directories stop the whole run at collection."""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_name_of_its_own():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    twice = sorted(n for n, k in names.items() if k > 1)
    assert not twice, f"test modules named alike in two directories: {twice}; rename one"


SKIPPING = """
import pytest

pytest.importorskip("{missing}")


def test_never_runs():
    pass
"""

TESTS_THAT_SKIP = """
import pytest


def test_without_root():
    pytest.skip("needs root to mount a small tmpfs")


@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_on_a_gpu():
    pass


def test_runs():
    pass
"""


def run_pytest(where: Path, ci: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    env["PYTHONPATH"] = str(TESTS)  # the plugin, as tests/conftest.py loads it
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "support.ci_skips", "-p", "no:cacheprovider", "-rs"]
    cmd += ["--continue-on-collection-errors", str(where)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=where, env=env, timeout=120)


def test_in_ci_a_skip_fails_the_run_unless_it_wants_a_cuda_device(tmp_path):
    """A module whose import is skipped (megatron-core no longer importing) and a test skipped for
    want of root fail under CI=true, with the reason and the fix; a CUDA skip stays a skip. Outside
    CI all three are skips."""
    (tmp_path / "test_some.py").write_text(TESTS_THAT_SKIP)
    (tmp_path / "test_module.py").write_text(SKIPPING.format(missing="no_such_module_here"))
    ci = run_pytest(tmp_path, ci=True)
    assert ci.returncode == 1 and "1 failed, 1 passed, 1 skipped, 1 error" in ci.stdout, ci.stdout
    assert "skipped in CI: Skipped: needs root to mount a small tmpfs" in ci.stdout
    assert "skipped in CI: Skipped: could not import 'no_such_module_here'" in ci.stdout
    assert "fix what made it skip" in ci.stdout
    assert "needs a CUDA device" in ci.stdout.split("short test summary info")[1]
    outside = run_pytest(tmp_path, ci=False)
    assert outside.returncode == 0 and "1 passed, 3 skipped" in outside.stdout, outside.stdout
