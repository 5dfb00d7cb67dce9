"""``make bench``'s comparison (rlhpc.devtools.bench) on given numbers: no benchmark is run here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlhpc.devtools.bench import RECORD, compare, last_json_line, load_record, report
from rlhpc.errors import RlhpcError

RECORDED = {
    "recorded": "2026-12-07",
    "machine": "test",
    "benchmarks": {
        "a": {"command": [], "ratios": {"speed": {"range": [0.7, 0.8], "better": "higher"}}},
        "b": {"command": [], "ratios": {"cost": {"range": [3.0, 4.0], "better": "lower"}}},
    },
}


@pytest.mark.parametrize(
    ("a", "b", "statuses"),
    [
        (0.75, 3.5, ["in range", "in range"]),
        (0.7, 4.0, ["in range", "in range"]),  # the ends belong to the spread
        (0.69, 4.1, ["worse", "worse"]),  # a speed below, a cost above
        (0.81, 2.9, ["better", "better"]),
    ],
)
def test_each_ratio_is_held_against_its_spread_and_its_direction(a: float, b: float, statuses: list[str]) -> None:
    verdicts = compare(RECORDED, {"a": {"speed": a, "other": 1}, "b": {"cost": b}})
    assert [v.status for v in verdicts] == statuses
    text = report(verdicts, RECORDED)
    for v in verdicts:
        assert (f"OUTSIDE {v.bench}.{v.key}" in text) == (v.status != "in range")


def test_a_failed_run_reports_its_ratios_missing() -> None:
    verdicts = compare(RECORDED, {"a": None, "b": {"other": 1}})
    assert [v.status for v in verdicts] == ["missing", "missing"]
    assert "MISSING a.speed" in report(verdicts, RECORDED)


def test_the_ratios_are_the_last_json_line() -> None:
    out = 'table\n{"not": "this"}\nmore text\n{"speed": 0.74, "n": 3}\n\n'
    assert last_json_line(out) == {"speed": 0.74, "n": 3}
    assert last_json_line("no json here\n{broken") is None


def test_the_recorded_spreads_are_well_formed_and_documented() -> None:
    record = load_record()
    doc = (RECORD.parent / "benchmarks.md").read_text()
    bench_dir = Path(__file__).resolve().parents[2] / "tools" / "bench"
    for name, bench in record["benchmarks"].items():
        assert (bench_dir / f"{name}.py").is_file(), name
        for key in bench["ratios"]:
            per_count = re.sub(r"(_n?)\d+$", r"\1<N>", key)  # push_vs_transport_<N>, fixed_over_ready_n<N>
            assert f"`{key}`" in doc or f"`{per_count}`" in doc, f"{name}.{key} is not in docs/benchmarks.md"


def test_a_malformed_spread_is_refused(tmp_path: Path) -> None:
    bad = json.loads(json.dumps(RECORDED))
    bad["benchmarks"]["a"]["ratios"]["speed"]["range"] = [0.9, 0.8]
    (tmp_path / "r.json").write_text(json.dumps(bad))
    with pytest.raises(RlhpcError, match=r"a.speed has range \[0.9, 0.8\]"):
        load_record(tmp_path / "r.json")


def test_a_benchmark_s_ratios_are_read_from_its_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlhpc.devtools import bench

    (tmp_path / "fine.py").write_text("import json\nprint('its table')\nprint(json.dumps({'speed': 0.9}))\n")
    (tmp_path / "broken.py").write_text("import json\nprint(json.dumps({'speed': 0.9}))\nraise SystemExit(3)\n")
    monkeypatch.setattr(bench, "BENCH_DIR", tmp_path)
    assert bench.run_bench("fine", [], timeout_s=120) == {"speed": 0.9}
    assert bench.run_bench("broken", [], timeout_s=120) is None  # a failed run reports nothing
