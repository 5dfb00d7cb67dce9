#!/usr/bin/env python3
"""What the sglang_router in the loop costs on CPU engines: its start, and a rollout's generation
sent through it one prompt per request against the same rollout sent to the engines directly in
one batch per engine (what rlhpc does with ``rollout.sglang.router: false``).

Two CPU engine servers (the embedded job's tiny model) with one key, the real router in front.
The router is started and stopped ``--starts`` times (a job starts it once after its engines,
and again whenever an engine restarts). Then the rollout (``--prompts`` x ``--samples``, each
sample its own seed, answers of exactly ``--max-new-tokens`` tokens) is generated ``--repeats``
times each way, the two ways alternating so that this machine's drift falls on both.

    python tools/bench/router.py [--prompts 8] [--samples 4] [--max-new-tokens 8] [--repeats 5]

The last line is one JSON object: ``router_start_s`` (median), ``router_stop_s``, ``direct_s``
and ``routed_s`` (median seconds per rollout), ``routed_over_direct``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # support.engines: a CPU engine server on a free port

from support.engines import start_server, stop_server  # noqa: E402

from rlhpc.engine_server.sglang import Router  # noqa: E402
from rlhpc.model import TinyModelConfig, build_tiny_model  # noqa: E402
from rlhpc.wire.client import EngineClient  # noqa: E402
from rlhpc.wire.engine_key import new_key  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--starts", type=int, default=5)
    a = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rlhpc-bench-router-"))
    model = str(build_tiny_model(work / "tiny", TinyModelConfig()))
    key = new_key(work / "engine_key")
    engines = [start_server(model, work, f"e{i}", key_path=work / "engine_key") for i in range(2)]
    urls = [u for _, u, _ in engines]
    router = Router("127.0.0.1", work / "router.log", 60.0, work / "engine_key")
    try:
        starts, stops = [], []
        for _ in range(a.starts):
            t = time.perf_counter()
            router.start(urls)
            starts.append(time.perf_counter() - t)
            t = time.perf_counter()
            router.stop()
            stops.append(time.perf_counter() - t)
        routed = EngineClient(router.start(urls), api_key=key, router=True)
        direct = [EngineClient(u, api_key=key) for u in urls]

        n = a.prompts * a.samples
        ids = [[3 + (k // a.samples) % 20, 5, 7, 11] for k in range(n)]
        params = [{"max_new_tokens": a.max_new_tokens, "sampling_seed": k, "ignore_eos": True} for k in range(n)]
        half = (n + 1) // 2

        def send_direct() -> None:  # one batch per engine, as the fan-out sends them without the router
            with ThreadPoolExecutor(2) as ex:
                list(ex.map(lambda e: direct[e].generate(input_ids=ids[e * half : (e + 1) * half],
                                                         sampling_params=params[e * half : (e + 1) * half],
                                                         return_logprob=True), range(2)))  # fmt: skip

        def send_routed() -> None:
            routed.generate(input_ids=ids, sampling_params=params, return_logprob=True)

        send_direct(), send_routed()  # warm both paths up
        times: dict[str, list[float]] = {"direct": [], "routed": []}
        for _ in range(a.repeats):
            for name, send in (("direct", send_direct), ("routed", send_routed)):
                t = time.perf_counter()
                send()
                times[name].append(time.perf_counter() - t)
    finally:
        router.stop()
        for proc, _, _ in engines:
            stop_server(proc)
    out = {
        "router_start_s": round(statistics.median(starts), 3),
        "router_stop_s": round(statistics.median(stops), 3),
        "direct_s": round(statistics.median(times["direct"]), 4),
        "routed_s": round(statistics.median(times["routed"]), 4),
        "samples": n,
        "max_new_tokens": a.max_new_tokens,
    }
    out["routed_over_direct"] = round(out["routed_s"] / out["direct_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
