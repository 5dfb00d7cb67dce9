#!/usr/bin/env python3
"""Weight-sync bandwidth: trainer -> engines against a plain in-process copy of the same bytes.

This process plays the trainer's rank 0 and holds a tiny-architecture Llama made a few hundred
MB big. Engines are real CPU engine server processes (``rlhpc.rollout.cpu_server``, port 0 +
ready file, one torch thread each, as the loop starts them). Timed, side by side in one run:

- copy: ``copy_`` of every parameter into preallocated tensors of the same shapes, in this
  process (the floor: the bytes moved once, memory to memory);
- disaggregated: ``DistributedWeightSender.send`` over a gloo group to 1 and 2 engines (HTTP
  announce per bucket, broadcast from rank 0, the engines copy into their parameters);
- colocate: ``TensorWeightSender.send`` (a clone into /dev/shm, the handles over HTTP in
  ``/update_weights_from_tensor``, the engines map and copy).

A send is the whole update as the loop does it: pause, every bucket, version check, continue.
Each case gets one untimed warm-up send; the median of ``--repeats`` timed sends is printed.
Before every send the trainer writes a fresh sentinel into each parameter, and after each case
every engine must report the last version, hold the sentinel in every parameter, and answer a
greedy generation exactly as this process does with the trainer's weights.

    python tools/bench/weight_sync.py
    python tools/bench/weight_sync.py --model-mb 1000 --repeats 5 --engines 1 2 4 --bucket-mb 128
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

import torch  # noqa: E402

from rlhpc.config import RolloutConfig  # noqa: E402
from rlhpc.model import TinyModelConfig, build_tiny_model, load_model, load_tokenizer  # noqa: E402
from rlhpc.rollout.client import EngineClient  # noqa: E402
from rlhpc.rollout.sampling import sample  # noqa: E402
from rlhpc.rollout.weight_sync import DistributedWeightSender, TensorWeightSender  # noqa: E402

log = logging.getLogger("bench.weight_sync")

LAYERS = 4
BYTES_PER_HIDDEN2 = 4 * 15 * LAYERS  # float32; per layer q,o: H^2 each, k,v: H^2/2 each, MLP 3 * H * 4H


def tiny_config(model_mb: float) -> TinyModelConfig:
    """A Llama of about ``model_mb`` MB of float32 parameters (the 48-token vocab is negligible)."""
    hidden = max(64, round(math.sqrt(model_mb * 1e6 / BYTES_PER_HIDDEN2) / 64) * 64)
    return TinyModelConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
    )


# ---------------------------------------------------------------- engines


def start_engine(model_path: str, work: Path, name: str, timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    ready = work / f"{name}.ready.json"
    logf = open(work / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhpc.rollout.cpu_server", "--model-path", model_path, "--port", "0"]
        + ["--ready-file", str(ready), "--parent-pid", str(os.getpid()), "--log-level", "WARNING"],
        stdout=logf,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"engine {name} did not start:\n{(work / f'{name}.log').read_text()[-3000:]}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return proc, f"http://{info['host']}:{info['port']}"


def stop_engine(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- checks


def mark(params: list[torch.Tensor], sentinel: float) -> None:
    """A value no earlier send carried, in every parameter: a stale engine cannot pass the check."""
    with torch.no_grad():
        for p in params:
            p.view(-1)[0] = sentinel


def check_engines(
    clients: list[EngineClient], model: torch.nn.Module, version: str, prompts: list[list[int]], tok
) -> None:
    ref = sample(model, prompts, [8] * len(prompts), [0.0] * len(prompts), [1.0] * len(prompts),
                 [None] * len(prompts), tok.eos_token_id, tok.pad_token_id)  # fmt: skip
    want_ids = [r.output_ids for r in ref]
    for c in clients:
        got = c.get_weight_version()
        if got != version:
            raise RuntimeError(f"{c.base_url} reports weight_version {got!r}, want {version!r}")
        for name, p in model.named_parameters():
            row = torch.tensor(c.get_weights_by_name(name, truncate_size=1), dtype=p.dtype)
            if not torch.equal(row.view(-1), p.detach()[:1].reshape(-1)):
                raise RuntimeError(f"{c.base_url}: parameter {name} differs from the trainer's")
        outs = c.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0})
        if [o["output_ids"] for o in outs] != want_ids:
            raise RuntimeError(f"{c.base_url}: greedy generation differs from the trainer's weights")


# ---------------------------------------------------------------- timing


def timed(repeats: int, fn: Callable[[], None], before: Callable[[], None] = lambda: None) -> list[float]:
    before()
    fn()  # warm-up: first-touch page faults, gloo buffers, HTTP connections
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-mb", type=float, default=256, help="size of the float32 model (approximate)")
    p.add_argument("--repeats", type=int, default=3, help="timed sends per case (median printed)")
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2], help="engine counts to send to")
    p.add_argument(
        "--bucket-mb",
        type=int,
        default=RolloutConfig().update_weight_buffer_mb,
        help="weight sync bucket (default: rollout.update_weight_buffer_mb)",
    )
    p.add_argument("--dir", type=Path, default=None, help="parent of the temp dir (default: the system temp dir)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # like each engine; the copy baseline is one thread too

    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="rlhpc-bench-wsync-", dir=args.dir))
    procs: list[subprocess.Popen] = []
    try:
        tiny = tiny_config(args.model_mb)
        model_path = str(build_tiny_model(work / "model", tiny))
        with ThreadPoolExecutor(max(args.engines)) as pool:  # start-up is mostly imports: overlap them
            started_engines = list(
                pool.map(lambda i: start_engine(model_path, work, f"engine{i}"), range(max(args.engines)))
            )
        procs = [proc for proc, _ in started_engines]
        clients = [EngineClient(url, timeout_s=600) for _, url in started_engines]

        model = load_model(model_path).requires_grad_(False)
        g = torch.Generator().manual_seed(1)
        for t in model.parameters():  # the trainer a few steps ahead of the engines' weights
            t.add_(torch.randn(t.shape, generator=g), alpha=0.02)
        params = [t for _, t in model.named_parameters()]
        named = [(n, t.detach()) for n, t in model.named_parameters()]
        nbytes = sum(t.numel() * t.element_size() for t in params)
        bucket = args.bucket_mb * 2**20
        tok = load_tokenizer(model_path)
        prompts = [[tok.bos_token_id, *tok(s, add_special_tokens=False).input_ids] for s in ("3+4=", "abc")]
        sentinels = itertools.count(1000)
        versions = itertools.count(1)
        last = {"version": 0}

        def bump() -> None:  # untimed: a new sentinel and version before every send
            mark(params, float(next(sentinels)))
            last["version"] = next(versions)

        rows = []
        dst = [torch.empty_like(t) for t in params]

        def copy() -> None:
            for d, t in zip(dst, params):
                d.copy_(t)

        copy_times = timed(args.repeats, copy)
        rows.append(("in-process copy_", 0, copy_times))
        dst.clear()  # the engines need the memory more

        for n in args.engines:
            group = clients[:n]
            sender = DistributedWeightSender(
                group, [1] * n, "127.0.0.1", "gloo", bucket, group_name=f"bench_{n}", timeout=600
            )
            try:
                sender.connect()
                times = timed(args.repeats, lambda s=sender: s.send(named, last["version"]), bump)
            finally:
                sender.close()
            check_engines(group, model, str(last["version"]), prompts, tok)
            rows.append(("disaggregated (gloo)", n, times))

        for n in args.engines:
            group = clients[:n]
            sender = TensorWeightSender(group, [1] * n, bucket)
            try:
                times = timed(args.repeats, lambda s=sender: s.send(named, last["version"]), bump)
            finally:
                sender.close()
            check_engines(group, model, str(last["version"]), prompts, tok)
            rows.append(("colocate (shared memory)", n, times))

        load1, _, _ = os.getloadavg()
        print(
            f"machine: {os.cpu_count()} cores, torch {torch.__version__}, 1 torch thread per process, "
            f"load average {load1:.2f} at the end"
        )
        print(
            f"model  : llama hidden {tiny.hidden_size}, MLP {tiny.intermediate_size}, {tiny.num_hidden_layers} "
            f"layers, float32, {len(params)} tensors, {nbytes / 1e6:.1f} MB; bucket {args.bucket_mb} MiB "
            f"({math.ceil(nbytes / bucket)} bucket(s) or more)"
        )
        print(
            f"median of {args.repeats} sends after one warm-up; GB/s = model bytes / s (each engine receives "
            "all of them); x copy = copy time / send time"
        )
        print()
        base = statistics.median(copy_times)
        print(f"| {'case':<24} | engines | {'MB':>6} | {'s (median)':>10} | {'GB/s':>6} | {'x copy':>6} | all (s)")
        print(f"|{'-' * 26}|---------|{'-' * 8}|{'-' * 12}|{'-' * 8}|{'-' * 8}|---------")
        for case, n, times in rows:
            med = statistics.median(times)
            print(
                f"| {case:<24} | {n if n else '-':>7} | {nbytes / 1e6:6.1f} | {med:10.3f} | {nbytes / med / 1e9:6.2f} "
                f"| {base / med:6.3f} | {' '.join(f'{t:.3f}' for t in times)}"
            )
        print()
        print(
            f"checked after each case: every engine reports the last weight version, holds that send's "
            f"sentinel in all {len(params)} tensors, and generates greedily as this process does"
        )
        print(f"total bench time {time.time() - started:.0f} s")
    finally:
        for proc in procs:
            stop_engine(proc)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
