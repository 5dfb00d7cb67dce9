"""``make bench``: run the benchmarks in tools/bench/ and hold each ratio against its recorded spread.

Every script there ends with one JSON line of ratios (each a side-by-side measure against a
baseline in the same run). ``docs/benchmarks.json`` keeps, beside ``docs/benchmarks.md``, the
range last recorded for each ratio, the command that measured it and which way is better. This
tool runs each benchmark with that command, compares, and names every ratio outside its range:
below it (worse) or above it (better: record the new range). It is a tool for developers, not a
test: timings on a shared machine drift, so a ratio outside its spread is a reason to look (and
to run it again), and its output belongs in the closing note of a change to a hot path.

    make bench                                  # every benchmark (some take minutes)
    make bench BENCH="weight_sync loop_overhead"
    python -m rlhpc.devtools.bench --only weight_sync --results out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhpc.errors import RlhpcError

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "benchmarks.json"
BENCH_DIR = ROOT / "tools" / "bench"


@dataclass(frozen=True)
class Verdict:
    bench: str
    key: str
    value: float | None  # None: the run did not report it
    low: float
    high: float
    better: str  # "higher" or "lower"

    @property
    def status(self) -> str:
        """ "in range", "worse", "better" or "missing"."""
        if self.value is None:
            return "missing"
        if self.low <= self.value <= self.high:
            return "in range"
        below = self.value < self.low
        return "worse" if below == (self.better == "higher") else "better"


def load_record(path: Path = RECORD) -> dict[str, Any]:
    record = json.loads(path.read_text())
    for name, bench in record["benchmarks"].items():
        for key, spec in bench["ratios"].items():
            low, high = spec["range"]
            if not low <= high or spec["better"] not in ("higher", "lower"):
                raise RlhpcError(
                    f"{path}: {name}.{key} has range {spec['range']} and better {spec['better']!r}",
                    'give [low, high] with low <= high and better "higher" or "lower"',
                )
    return record


def last_json_line(output: str) -> dict[str, Any] | None:
    """The last line of a benchmark's output that is a JSON object (its ratios)."""
    for line in reversed(output.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                found = json.loads(line)
            except ValueError:
                continue
            if isinstance(found, dict):
                return found
    return None


def compare(record: dict[str, Any], results: dict[str, dict[str, Any] | None]) -> list[Verdict]:
    """Each recorded ratio of the benchmarks in ``results`` (name -> its JSON line, None when the
    run failed) against its recorded range."""
    verdicts = []
    for name, ratios in results.items():
        for key, spec in record["benchmarks"][name]["ratios"].items():
            value = (ratios or {}).get(key)
            low, high = spec["range"]
            verdicts.append(Verdict(name, key, float(value) if value is not None else None, low, high, spec["better"]))
    return verdicts


def report(verdicts: list[Verdict], record: dict[str, Any]) -> str:
    lines = [
        f"ratios against the spread recorded in docs/benchmarks.json ({record.get('recorded', '?')}, "
        f"{record.get('machine', '?')}):",
        "",
        f"| {'benchmark':<15} | {'ratio':<40} | {'now':>7} | {'recorded':>13} | better | status",
        f"|{'-' * 17}|{'-' * 42}|{'-' * 9}|{'-' * 15}|--------|---------",
    ]
    for v in verdicts:
        now = "-" if v.value is None else f"{v.value:.3f}"
        lines.append(
            f"| {v.bench:<15} | {v.key:<40} | {now:>7} | {f'{v.low:g}-{v.high:g}':>13} | {v.better:<6} | {v.status}"
        )
    outside = [v for v in verdicts if v.status != "in range"]
    lines.append("")
    if not outside:
        lines.append("every ratio is within its recorded spread")
    for v in outside:
        what = {"worse": "below", "better": "above", "missing": "not reported by"}[v.status]
        if v.status == "missing":
            lines.append(f"MISSING {v.bench}.{v.key}: {what} the run (did it fail?)")
        else:
            lines.append(
                f"OUTSIDE {v.bench}.{v.key} = {v.value:.3f}, {what} its spread {v.low:g}-{v.high:g} ({v.status})"
            )
    return "\n".join(lines)


def run_bench(name: str, args: list[str], timeout_s: float) -> dict[str, Any] | None:
    """Run tools/bench/<name>.py with ``args``, its output shown as it comes; return its ratios
    (None when it failed or ran past ``timeout_s``)."""
    cmd = [sys.executable, str(BENCH_DIR / f"{name}.py"), *args]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
    watchdog = threading.Timer(timeout_s, proc.kill)
    watchdog.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
        proc.wait()
    finally:
        watchdog.cancel()
    took = time.monotonic() - started
    if took >= timeout_s:
        print(f"=== {name}: killed after {timeout_s:.0f}s", flush=True)
        return None
    print(f"=== {name}: exit {proc.returncode} after {took:.0f}s", flush=True)
    return last_json_line("".join(lines)) if proc.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="NAME", help="these benchmarks (tools/bench/NAME.py) only")
    p.add_argument("--record", type=Path, default=RECORD, help="the recorded spreads (default: docs/benchmarks.json)")
    p.add_argument("--results", type=Path, help="also write every benchmark's ratios and the verdicts here (JSON)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per benchmark before it is killed")
    args = p.parse_args(argv)
    record = load_record(args.record)
    names = args.only or list(record["benchmarks"])
    unknown = [n for n in names if n not in record["benchmarks"]]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; recorded: {sorted(record['benchmarks'])}", file=sys.stderr)
        return 2
    results = {n: run_bench(n, record["benchmarks"][n]["command"], args.timeout) for n in names}
    verdicts = compare(record, results)
    print()
    print(report(verdicts, record))
    if args.results:
        args.results.write_text(
            json.dumps(
                {"results": results, "verdicts": [v.__dict__ | {"status": v.status} for v in verdicts]}, indent=1
            )
        )
    return 1 if any(v.status in ("worse", "missing") for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
