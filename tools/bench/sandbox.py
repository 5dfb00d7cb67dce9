#!/usr/bin/env python3
"""The sandbox's pool against plain subprocesses: executions per second of the same code on the
same cores, and the start latency of a sandbox cold and warm.

- plain: what a reward would do without rlhpc: one ``python3 -I -c CODE`` per execution
  (``subprocess.run``), ``--workers`` at a time, no isolation and no limits;
- pool: ``SandboxPool.run_all`` of the same executions through ``--workers`` warm sandboxes
  (``sandbox.backend``, bubblewrap by default: its own namespaces, the limits, each execution
  in a fresh forked child, everything it left killed and removed after it).

Both run the same snippets (``--code``: a small Python program, by default a loop of 10^4
additions and a print) and check the same output. The sides take turns (plain, pool, plain, ...)
so a machine whose load drifts moves both alike; a turn's ratio is pool executions per second
/ plain's, and the figure is the median over ``--repeats`` turns. Start latency: the time to a
first execution's answer in a new sandbox (cold: the sandbox starts), against an execution in a
warm one and against one plain subprocess, medians of ``--starts`` tries.

    python tools/bench/sandbox.py
    python tools/bench/sandbox.py --workers 2 --executions 200 --repeats 5 --backend bwrap

The last line is one JSON object: ``pool_vs_plain`` (the median ratio: the goal is >= 0.8), each
side's executions per second, ``cold_start_ms``, ``warm_ms``, ``plain_ms`` and ``cold_vs_warm``
(cold / warm). Timings are never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from rlhpc.config import SandboxConfig
from rlhpc.sandbox.backends import python_of
from rlhpc.sandbox.pool import Job, SandboxPool

CODE = "total = 0\nfor i in range(10000):\n    total += i\nprint(total)"


def plain(python: str, code: str, executions: int, workers: int) -> tuple[float, list[str]]:
    def one(_: int) -> str:
        return subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=60).stdout

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        outs = list(ex.map(one, range(executions)))
    return time.perf_counter() - start, outs


def pooled(pool: SandboxPool, code: str, executions: int) -> tuple[float, list[str]]:
    start = time.perf_counter()
    results = pool.run_all([Job(code)] * executions)
    return time.perf_counter() - start, [r.stdout for r in results]


def latencies(cfg: SandboxConfig, python: str, code: str, tries: int) -> dict[str, float]:
    cold, warm, one = [], [], []
    for _ in range(tries):
        pool = SandboxPool(cfg)
        start = time.perf_counter()
        pool.run(code)  # the sandbox starts on first use
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        pool.run(code)
        warm.append(time.perf_counter() - start)
        pool.close()
        start = time.perf_counter()
        subprocess.run([python, "-I", "-c", code], capture_output=True, timeout=60)
        one.append(time.perf_counter() - start)
    return {
        "cold_start_ms": 1000 * statistics.median(cold),
        "warm_ms": 1000 * statistics.median(warm),
        "plain_ms": 1000 * statistics.median(one),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="executions at once, each side")
    ap.add_argument("--executions", type=int, default=200, help="executions per turn, each side")
    ap.add_argument("--repeats", type=int, default=5, help="turns of (plain, pool)")
    ap.add_argument("--starts", type=int, default=5, help="tries of the cold and warm latency")
    ap.add_argument("--backend", default="bwrap", choices=("bwrap", "apptainer", "subprocess"))
    ap.add_argument("--image", default=None, help="apptainer: the image")
    ap.add_argument("--code", default=CODE, help="the Python program each execution runs")
    args = ap.parse_args(argv)

    cfg = SandboxConfig(backend=args.backend, image=args.image, pool_size=args.workers)
    python = python_of(SandboxConfig()) if args.backend == "apptainer" else python_of(cfg)
    pool = SandboxPool(cfg)
    pool.start()
    pooled(pool, args.code, args.workers)  # every sandbox has run once
    expected = subprocess.run([python, "-I", "-c", args.code], capture_output=True, text=True).stdout
    turns = []
    same = True
    for turn in range(args.repeats):
        plain_s, plain_out = plain(python, args.code, args.executions, args.workers)
        pool_s, pool_out = pooled(pool, args.code, args.executions)
        same = same and set(plain_out) == set(pool_out) == {expected}
        turns.append({"plain_eps": args.executions / plain_s, "pool_eps": args.executions / pool_s})
        print(f"turn {turn}: plain {turns[-1]['plain_eps']:.1f}/s, pool {turns[-1]['pool_eps']:.1f}/s", flush=True)
    pool.close()
    lat = latencies(SandboxConfig(backend=args.backend, image=args.image, pool_size=1), python, args.code, args.starts)
    ratio = statistics.median(t["pool_eps"] / t["plain_eps"] for t in turns)
    print(
        f"{args.backend}, {args.workers} workers: pool {statistics.median(t['pool_eps'] for t in turns):.1f} exec/s, "
        f"plain {statistics.median(t['plain_eps'] for t in turns):.1f} exec/s (ratio {ratio:.2f}); "
        f"start cold {lat['cold_start_ms']:.0f} ms, warm {lat['warm_ms']:.1f} ms, plain subprocess {lat['plain_ms']:.1f} ms"
    )
    out = {
        "pool_vs_plain": round(ratio, 3),
        "pool_eps": round(statistics.median(t["pool_eps"] for t in turns), 1),
        "plain_eps": round(statistics.median(t["plain_eps"] for t in turns), 1),
        "cold_start_ms": round(lat["cold_start_ms"], 1),
        "warm_ms": round(lat["warm_ms"], 2),
        "plain_ms": round(lat["plain_ms"], 2),
        "cold_vs_warm": round(lat["cold_start_ms"] / lat["warm_ms"], 1),
        "same_output": same,
        "backend": args.backend,
        "workers": args.workers,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
