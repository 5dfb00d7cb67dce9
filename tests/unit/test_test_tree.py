"""The test tree itself: pytest imports every test module by its basename (no packages), so two
modules of one name in different directories stop the whole run at collection."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_name_of_its_own():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    twice = sorted(n for n, k in names.items() if k > 1)
    assert not twice, f"test modules named alike in two directories: {twice}; rename one"
