#!/usr/bin/env python3
"""Weight-sync speed: trainer -> engines against the raw transport and an in-process copy of the same bytes.

This process plays the trainer's rank 0 and holds a tiny-architecture Llama made a few hundred
MB big. Engines are real CPU engine server processes (``rlhpc.engine_server.cpu``, port 0 +
ready file, one torch thread each, as the loop starts them). Each case is timed in turns with its
baseline in the same run (baseline, case, baseline, case, ...), so a machine whose speed drifts
(a VM with neighbours: single sends here range 0.6x to 1.5x of their median) moves both alike:

- copy: ``copy_`` of every parameter into preallocated tensors of the same shapes, in this
  process (the floor for colocate: the bytes moved once, memory to memory);
- raw transport: ONE ``dist.broadcast`` of a flat uint8 buffer of the model's bytes from this
  process to N helper processes (this script in ``--raw-receiver`` mode, one torch thread
  each, like an engine) over the same kind of group the push uses (gloo, joined with
  ``init_custom_process_group`` as the engines join), followed by a barrier so the time covers
  every receiver holding the bytes. The helpers are not the engine processes (an engine has no
  route for a bare broadcast, and a measuring-only route would have to exist in SGLang too), but
  they are the same kind of process on the same host over the same kind of group;
- disaggregated: ``DistributedWeightSender.send`` over a gloo group to N engines, in turns with
  the raw transport to N helpers (which wait in their next broadcast meanwhile);
- colocate: ``TensorWeightSender.send`` (shared-memory handles over HTTP, the engines copy), in
  turns with the copy;
- the same two with the trainer-side levers: parameters laid out flat (``flatten_parameters``:
  a bucket is a view, nothing packed) and parameters living in shared memory
  (``share_memory_by_name``: handles sent as they are, nothing staged);
- fixed cost: the whole push (both channels) of the tests' tiny model to an engine holding it,
  in turns with one HTTP round trip to that engine (``/model_info``, the route the version
  check uses).

A send is the whole update as the loop does it: pause, begin the weight-update session, every
bucket, end the session, version check, continue.
Each case and baseline gets one untimed warm-up, then ``--repeats`` turns; a ratio is the median
over the turns of the two times' ratio in each. Before every send the trainer writes a fresh
sentinel into each parameter, and after each case every engine must report the last version,
hold the sentinel in every parameter, and answer a greedy generation exactly as this process
does with the trainer's weights.

The last line is one JSON object of ratios (speed ratios: 1 = as fast as the baseline):
``push_vs_transport`` = raw broadcast time / disaggregated push time (worst over engine
counts), ``colocate_vs_copy`` = copy time / colocated push time (one engine),
``push_vs_rtt`` = tiny model's disaggregated push time / one HTTP round trip (a cost ratio);
``push_flat_trainer_vs_transport`` and ``colocate_shm_trainer_vs_copy`` the same with the
trainer-side levers (the loop's torch actor uses both since 2026-12-04: flat parameters, and on
CPU, colocated, parameters in shared memory).

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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rlhpc.config import RolloutConfig, TinyModelConfig
from rlhpc.engine_server.cpu.sampling import sample
from rlhpc.model import build_tiny_model, load_model, load_tokenizer
from rlhpc.weights.broadcast import DistributedWeightSender
from rlhpc.weights.shared_memory import TensorWeightSender
from rlhpc.weights.tensor_transport import flatten_parameters, share_memory_by_name
from rlhpc.weights.update_group import create_master_store, init_custom_process_group
from rlhpc.wire.client import EngineClient

REPO = Path(__file__).resolve().parents[2]
log = logging.getLogger("bench.weight_sync")

LAYERS = 4
BYTES_PER_HIDDEN2 = 4 * 15 * LAYERS  # float32; per layer q,o: H^2 each, k,v: H^2/2 each, MLP 3 * H * 4H
RAW_GROUP = "bench_raw"
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


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


def start_engine(
    model_path: str, work: Path, name: str, timeout_s: float = 300, flags: list[str] | None = None
) -> tuple[subprocess.Popen, str]:
    """A CPU engine server as the loop starts one; ``flags``: more of its (SGLang's) flags."""
    ready = work / f"{name}.ready.json"
    logf = open(work / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhpc.engine_server.cpu", "--model-path", model_path, "--port", "0"]
        + ["--ready-file", str(ready), "--parent-pid", str(os.getpid()), "--log-level", "WARNING"]
        + (flags or []),
        stdout=logf,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, **CHILD_ENV},
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


# ---------------------------------------------------------------- raw transport


def raw_receiver(master: str, port: int, rank: int, world: int, nbytes: int, count: int) -> None:
    """Helper process: join the group like an engine does and receive ``count`` flat broadcasts."""
    torch.set_num_threads(1)
    pg = init_custom_process_group("gloo", master, port, rank, world, RAW_GROUP, timeout=600)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(count):
        dist.broadcast(buf, group_src=0, group=pg)
        dist.barrier(group=pg)
    dist.destroy_process_group(pg)


class RawBroadcast:
    """The raw transport: ``n`` helper processes in a group with this one, each receiving
    ``count`` flat broadcasts of ``nbytes``; ``once`` sends one (+ a barrier). The helpers wait
    in their next broadcast between two sends, so the push being compared can run in between."""

    def __init__(self, n: int, nbytes: int, count: int, work: Path):
        self.n, self.work = n, work
        store = create_master_store("127.0.0.1", 1 + n, timeout=600)
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--raw-receiver", "127.0.0.1", str(store.port), str(r), str(1 + n)]
                + [str(nbytes), str(count)],
                cwd=REPO,
                env={**os.environ, **CHILD_ENV},
                stdout=open(work / f"raw{n}_{r}.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
            )
            for r in range(1, n + 1)
        ]
        self.pg = init_custom_process_group("gloo", "127.0.0.1", store.port, 0, 1 + n, RAW_GROUP, 600, store)
        self.buf = torch.ones(nbytes, dtype=torch.uint8)

    def once(self) -> None:
        dist.broadcast(self.buf, group_src=0, group=self.pg)
        dist.barrier(group=self.pg)

    def close(self) -> None:
        """After the last of ``count`` sends: the helpers exit."""
        dist.destroy_process_group(self.pg)
        for proc in self.procs:
            if proc.wait(120) != 0:
                raise RuntimeError(f"raw receiver failed:\n{(self.work / f'raw{self.n}_1.log').read_text()[-3000:]}")


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


@dataclass
class Paired:
    """A case timed in turns with its baseline (one of each per turn, after one warm-up of
    each), so a machine whose speed drifts moves both alike."""

    times: list[float]
    baseline: list[float]

    @property
    def ratio(self) -> float:
        """Median over the turns of baseline seconds / case seconds (1 = as fast as the baseline)."""
        return statistics.median(b / t for b, t in zip(self.baseline, self.times))

    @property
    def cost(self) -> float:
        """Median over the turns of case seconds / baseline seconds (how many baselines a case costs)."""
        return statistics.median(t / b for b, t in zip(self.baseline, self.times))


def in_turns(
    repeats: int, baseline: Callable[[], None], case: Callable[[], None], before: Callable[[], None] = lambda: None
) -> Paired:
    """``baseline`` then ``case`` (``before`` untimed ahead of each case run), ``repeats`` turns."""
    baseline()
    before()
    case()
    paired = Paired([], [])
    for _ in range(repeats):
        t0 = time.perf_counter()
        baseline()
        paired.baseline.append(time.perf_counter() - t0)
        before()
        t0 = time.perf_counter()
        case()
        paired.times.append(time.perf_counter() - t0)
    return paired


class Trainer:
    """A model whose parameters get a fresh sentinel and version before every send."""

    def __init__(self, model_path: str, versions: itertools.count, sentinels: itertools.count):
        self.model = load_model(model_path).requires_grad_(False)
        g = torch.Generator().manual_seed(1)
        for t in self.model.parameters():  # the trainer a few steps ahead of the engines' weights
            t.add_(torch.randn(t.shape, generator=g), alpha=0.02)
        self.params = [t for _, t in self.model.named_parameters()]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.params)
        self.version = 0
        self._versions, self._sentinels = versions, sentinels
        self.tok = load_tokenizer(model_path)
        self.prompts = [
            [self.tok.bos_token_id, *self.tok(s, add_special_tokens=False).input_ids] for s in ("3+4=", "abc")
        ]

    def bump(self) -> None:  # untimed
        mark(self.params, float(next(self._sentinels)))
        self.version = next(self._versions)

    def time_sends(
        self, sender: DistributedWeightSender | TensorWeightSender, repeats: int, baseline: Callable[[], None]
    ) -> Paired:
        """The sender's pushes, in turns with ``baseline``."""
        try:
            sender.connect()
            named = [(n, t.detach()) for n, t in self.model.named_parameters()]  # storages may have moved
            return in_turns(repeats, baseline, lambda: sender.send(named, self.version), self.bump)
        finally:
            sender.close()

    def check(self, clients: list[EngineClient]) -> None:
        check_engines(clients, self.model, str(self.version), self.prompts, self.tok)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-receiver":
        master, port, rank, world, nbytes, count = sys.argv[2:8]
        raw_receiver(master, int(port), int(rank), int(world), int(nbytes), int(count))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-mb", type=float, default=256, help="size of the float32 model (approximate)")
    p.add_argument("--repeats", type=int, default=3, help="timed sends per case (median printed)")
    p.add_argument("--tiny-repeats", type=int, default=20, help="turns of a tiny-model push and one round trip")
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
    versions, sentinels = itertools.count(1), itertools.count(1000)
    try:
        tiny = tiny_config(args.model_mb)
        model_path = str(build_tiny_model(work / "model", tiny))
        small_path = str(build_tiny_model(work / "small", TinyModelConfig()))  # the tests' tiny model
        n_big = max(args.engines)
        with ThreadPoolExecutor(n_big + 1) as pool:  # start-up is mostly imports: overlap them
            paths = [model_path] * n_big + [small_path]
            started_engines = list(pool.map(lambda i: start_engine(paths[i], work, f"engine{i}"), range(n_big + 1)))
        procs = [proc for proc, _ in started_engines]
        clients = [EngineClient(url, timeout_s=600) for _, url in started_engines]
        small_client = clients.pop()

        big = Trainer(model_path, versions, sentinels)
        nbytes, bucket = big.nbytes, args.bucket_mb * 2**20
        dst = [torch.empty_like(t) for t in big.params]

        def copy() -> None:
            for d, t in zip(dst, big.params):
                d.copy_(t)

        def disaggregated(n: int, name: str) -> Paired:
            """Pushes to the first ``n`` engines in turns with a raw broadcast to ``n`` helpers."""
            raw = RawBroadcast(n, nbytes, args.repeats + 1, work)
            try:
                sender = DistributedWeightSender(clients[:n], [1] * n, "127.0.0.1", "gloo", bucket, group_name=name)
                paired = big.time_sends(sender, args.repeats, raw.once)
            finally:
                raw.close()
            big.check(clients[:n])
            return paired

        def colocated(n: int) -> Paired:
            paired = big.time_sends(TensorWeightSender(clients[:n], [1] * n, bucket), args.repeats, copy)
            big.check(clients[:n])
            return paired

        RAW, COPY = "raw broadcast", "in-process copy"
        rows: list[tuple[str, int, str, Paired]] = []
        push = {n: disaggregated(n, f"bench_{n}") for n in args.engines}
        rows += [("disaggregated (gloo)", n, RAW, push[n]) for n in args.engines]
        colo = {n: colocated(n) for n in args.engines}
        rows += [("colocate (shared memory)", n, COPY, colo[n]) for n in args.engines]
        # the trainer-side levers: parameters laid out flat (a bucket is a view, no packing) and,
        # for colocate, parameters that live in shared memory (handles as they are, no staging)
        flatten_parameters(big.model)
        push_flat = {n: disaggregated(n, f"bench_flat_{n}") for n in args.engines}
        rows += [("disaggregated, flat trainer", n, RAW, push_flat[n]) for n in args.engines]
        share_memory_by_name(big.model)
        colo_shared = colocated(1)
        rows.append(("colocate, trainer in shm", 1, COPY, colo_shared))

        # fixed cost: a model of a few hundred KB, where a push is all round trips and bookkeeping;
        # laid out flat, as the loop's actor is (its bucket is a view: nothing packed)
        small = Trainer(small_path, versions, sentinels)
        flatten_parameters(small.model)
        rtt = small_client.get_model_info
        tiny_sender = DistributedWeightSender([small_client], [1], "127.0.0.1", "gloo", bucket, group_name="bench_tiny")
        tiny_dis = small.time_sends(tiny_sender, args.tiny_repeats, rtt)
        small.check([small_client])
        tiny_colo = small.time_sends(TensorWeightSender([small_client], [1], bucket), args.tiny_repeats, rtt)
        small.check([small_client])

        load1, _, _ = os.getloadavg()
        print(
            f"machine: {os.cpu_count()} cores, torch {torch.__version__}, 1 torch thread per process, "
            f"load average {load1:.2f} at the end"
        )
        print(
            f"model  : llama hidden {tiny.hidden_size}, MLP {tiny.intermediate_size}, {tiny.num_hidden_layers} "
            f"layers, float32, {len(big.params)} tensors, {nbytes / 1e6:.1f} MB; bucket {args.bucket_mb} MiB "
            f"({math.ceil(nbytes / bucket)} bucket(s) or more)"
        )
        print(
            f"each case in {args.repeats} turns with its baseline (one of each per turn, after one warm-up); "
            "GB/s = model bytes / s (each engine receives all of them); x baseline = median over the turns "
            "of baseline s / case s"
        )
        print()
        print(
            f"| {'case':<28} | engines | {'MB':>6} | {'s (median)':>10} | {'GB/s':>6} | {'baseline':<15} "
            f"| {'its s':>6} | {'x base':>6} | all (s)"
        )
        print(f"|{'-' * 30}|---------|{'-' * 8}|{'-' * 12}|{'-' * 8}|{'-' * 17}|{'-' * 8}|{'-' * 8}|---------")
        for case, n, base, paired in rows:
            m = statistics.median(paired.times)
            print(
                f"| {case:<28} | {n:>7} | {nbytes / 1e6:6.1f} | {m:10.3f} | {nbytes / m / 1e9:6.2f} | {base:<15} "
                f"| {statistics.median(paired.baseline):6.3f} | {paired.ratio:6.3f} "
                f"| {' '.join(f'{t:.3f}' for t in paired.times)}"
            )
        rtt_s = statistics.median(tiny_dis.baseline + tiny_colo.baseline)
        print()
        print(
            f"tiny model ({small.nbytes / 1e3:.0f} KB, {len(small.params)} tensors), 1 engine, {args.tiny_repeats} "
            f"turns: one HTTP round trip (/model_info) {rtt_s * 1e3:.2f} ms; whole push disaggregated "
            f"{statistics.median(tiny_dis.times) * 1e3:.1f} ms ({tiny_dis.cost:.1f} round trips), colocate "
            f"{statistics.median(tiny_colo.times) * 1e3:.1f} ms ({tiny_colo.cost:.1f} round trips)"
        )
        print(
            "checked after each case: every engine reports the last weight version, holds that send's "
            "sentinel in every tensor, and generates greedily as this process does"
        )
        print(f"total bench time {time.time() - started:.0f} s")
        ratios: dict[str, float | int | str] = {
            "push_vs_transport": min(push[n].ratio for n in args.engines),
            "colocate_vs_copy": colo[min(args.engines)].ratio,
            "push_vs_rtt": tiny_dis.cost,
            "colocate_push_vs_rtt": tiny_colo.cost,
            "push_flat_trainer_vs_transport": min(push_flat[n].ratio for n in args.engines),
            "colocate_shm_trainer_vs_copy": colo_shared.ratio,
        }
        for n in args.engines:
            ratios[f"push_vs_transport_{n}"] = push[n].ratio
            ratios[f"push_flat_trainer_vs_transport_{n}"] = push_flat[n].ratio
            ratios[f"colocate_vs_copy_{n}"] = colo[n].ratio
        ratios = {k: round(v, 4) for k, v in ratios.items()}
        ratios.update(model_mb=round(nbytes / 1e6, 1), bucket_mb=args.bucket_mb, repeats=args.repeats)
        print(json.dumps(ratios))
    finally:
        for proc in procs:
            stop_engine(proc)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
