#!/usr/bin/env python3
"""LoRA side by side: an adapter push against a full push of the same model, a LoRA train step
against a full fine-tuning one, and many LoRA runs on one fleet against one fleet each.

``push`` (``--push-*``): one torch actor rank (a real ``TrainWorker`` with ``actor.lora``, rank
``--rank``, all-linear, a world of one over gloo, no Ray) holding a tiny-architecture Llama made
``--model-mb`` big (>= 100M parameters by default), connected to a real CPU engine server started
with the adapter flags as a run starts it, pushes through the actor's own ``update_weights`` in
turns: the adapter (``actor.lora.push: adapter``: PEFT files written under the push dir, the
engine paused, its adapter unloaded and the new one loaded from them, the version set, resumed)
and the full merged weights of the same model (``push: merged``: the gloo broadcast a full
fine-tuning push takes, buckets of ``rollout.update_weight_buffer_mb``). After the turns the
engine must report the last version. The adapter push is
also split: its files written, the engine's part, and one HTTP round trip (``/model_info``).

``train`` (``--train-*``): the same model trained one step (``RankBase.train``: forward, loss,
backward, AdamW) with LoRA and with full fine-tuning on the same batch (``tools/bench/train_step``'s
long-tailed lengths), each side a process of its own (one torch thread, as the actor's ranks in
tests), stepping in turns; peak memory is the process's peak resident set during its steps
(Linux's VmHWM, reset after the model is loaded): on CPU the model, gradients, AdamW state and
activations all live there.

``fleet`` (``--runs`` ... ``--train-s``): CPU engine servers (the embedded job's tiny model)
serving LoRA adapters, as a ``--shared-fleet`` sweep starts them. Each of the K runs is a thread
doing what a run's loop does to its engines, ``--rollouts`` times: push its adapter (unload, load
its PEFT files: the shared push, no pause), generate a rollout (``--prompts`` x ``--samples``,
each sample its own seed, answers of exactly ``--max-new-tokens`` tokens) naming its adapter,
then ``--train-s`` seconds away from the engines (a stand-in for its training step, a sleep). On
one fleet, a run's rollout is spread over every engine (as the run's fan-out spreads it); on K
fleets it goes to its own engine, which idles while its run trains. A third way: the K runs on a
fleet of ONE engine (what a shared fleet saves: K - 1 engines). The ways alternate ``--repeats``
times, so this machine's drift falls on each.

    python tools/bench/lora.py [--parts push train fleet] [--repeats 2] [--push-repeats 5] \\
        [--model-mb 440] [--rank 16] [--train-turns 3] [--runs 2] [--rollouts 4] ...

The last line is one JSON object. push: ``adapter_push_over_full`` (median over the turns of
adapter push s / full push s; goal <= 0.05), ``adapter_bytes_over_full``, the seconds and bytes.
train: ``lora_step_time_over_full`` and ``lora_peak_mem_over_full`` (medians / peaks of the two
sides). fleet: ``shared_rollouts_per_s`` and ``separate_rollouts_per_s`` (medians over the
repeats, all runs' rollouts per wall second), ``shared_over_separate``; and
``one_engine_rollouts_per_s``, ``one_engine_over_separate`` (the same runs on 1 engine against K).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # support.engines: a CPU engine server on a free port
sys.path.insert(0, str(REPO / "tools" / "bench"))  # weight_sync's engines and turns, train_step's batches

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from support.engines import start_server, stop_server  # noqa: E402
from train_step import long_tailed_batch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from weight_sync import CHILD_ENV, in_turns, start_engine, stop_engine, tiny_config  # noqa: E402

from rlhpc.actor.spec import ActorSpec  # noqa: E402
from rlhpc.actor.worker import TrainWorker  # noqa: E402
from rlhpc.config import Config  # noqa: E402
from rlhpc.config import LoraConfig as ActorLora  # noqa: E402
from rlhpc.model import TinyModelConfig, build_tiny_model  # noqa: E402
from rlhpc.wire import protocol as P  # noqa: E402
from rlhpc.wire.client import EngineClient  # noqa: E402
from rlhpc.wire.engine_key import new_key  # noqa: E402
from rlhpc.wire.lora import LoraServing, not_loaded  # noqa: E402

RANK = 8


def adapter_dir(model: str, out: Path, seed: int) -> str:
    """A rank-8 all-linear adapter of the model, its B drawn (a trained one's is not zero)."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model), LoraConfig(r=RANK, lora_alpha=16, target_modules="all-linear")
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    peft_model.save_pretrained(out)
    return str(out)


def run_loop(clients: list[EngineClient], name: str, path: str, a: argparse.Namespace, seed0: int) -> None:
    """One run's turns on its engines: push, generate (spread over ``clients``), train (a sleep)."""
    n = a.prompts * a.samples
    ids = [[3 + (k // a.samples) % 20, 5, 7, 11] for k in range(n)]
    part = (n + len(clients) - 1) // len(clients)
    with ThreadPoolExecutor(len(clients)) as ex:
        for r in range(a.rollouts):
            for c in clients:
                try:
                    c.unload_lora_adapter(name)
                except Exception as e:  # the first push: nothing loaded yet
                    if not_loaded(name) not in str(e):
                        raise
                c.load_lora_adapter(P.LoadLoRAAdapterReqInput(lora_name=name, lora_path=path))
            params = [
                {"max_new_tokens": a.max_new_tokens, "sampling_seed": seed0 + r * n + k, "ignore_eos": True}
                for k in range(n)
            ]
            list(ex.map(lambda e, ps=params: clients[e].generate(input_ids=ids[e * part : (e + 1) * part],
                                                                  sampling_params=ps[e * part : (e + 1) * part],
                                                                  return_logprob=True), range(len(clients))))  # fmt: skip
            time.sleep(a.train_s)


def actor(model_path: str, lora_rank: int | None, push_dir: Path | None = None) -> TrainWorker:
    """One torch actor rank (a world of one over gloo) on ``model_path``: with ``actor.lora`` at
    ``lora_rank`` (all-linear, pushing its adapter's files under ``push_dir``), or full fine-tuning."""
    cfg = Config(deterministic=True)
    cfg.actor.lr = 0.0  # the same weights every step: every turn does the same work
    cfg.actor.micro_batch_size = 4
    cfg.rollout.max_new_tokens = 64
    if lora_rank is not None:
        cfg.actor.lora = ActorLora(rank=lora_rank, alpha=2.0 * lora_rank)
    worker = TrainWorker(
        ActorSpec.from_config(cfg, lora_push_dir=str(push_dir) if push_dir else None), model_path, 0, 1
    )
    worker.init_process_group(worker.rendezvous(one_node=True))
    return worker


def push_part(a: argparse.Namespace, work: Path, model_path: str) -> dict:
    """The adapter push against the merged full push, in turns, through the actor's update_weights."""
    from dataclasses import replace

    from rlhpc.actor import lora

    proc, url = start_engine(
        model_path, work, "push_engine", flags=LoraServing.for_adapter(a.rank, "all-linear").flags()
    )
    try:
        worker = actor(model_path, a.rank, work / "lora_push")
        with torch.no_grad():  # a trained adapter: B is not zero
            for name, p in worker.module.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
        params = sum(p.numel() for n, p in worker.module.named_parameters() if ".lora_" not in n)
        adapter_spec, full_spec = worker.spec, replace(worker.spec, lora_push_dir=None)
        worker.connect_rollout([url], [1], colocate=False)
        client = EngineClient(url, timeout_s=600)
        version = iter(range(1, 10_000))

        def push(spec: ActorSpec) -> None:
            worker.spec = spec
            error = worker.update_weights(next(version))
            if error is not None:
                raise RuntimeError(f"push failed: {error}")

        paired = in_turns(a.push_repeats, lambda: push(full_spec), lambda: push(adapter_spec))
        last = str(next(version) - 1)
        if client.get_weight_version() != last:
            raise RuntimeError(f"the engine reports weight_version {client.get_weight_version()!r}, want {last}")
        pushed = Path(adapter_spec.lora_push_dir) / f"v{int(last):06d}"
        adapter_bytes = sum(f.stat().st_size for f in pushed.iterdir())
        full_bytes = sum(t.numel() * t.element_size() for _, t in lora.merged_named(worker.module))
        # the adapter push's parts: its files written; the engine's part (pause, unload, load the
        # files, version, continue); one HTTP round trip
        write_s, engine_s, rtt_s = [], [], []
        for _ in range(a.push_repeats):
            v = next(version)
            t0 = time.perf_counter()
            d = worker._write_push_adapter(v)
            t1 = time.perf_counter()
            worker.sender.send_adapter(adapter_spec.lora_adapter, d, v)
            t2 = time.perf_counter()
            client.get_model_info()
            write_s.append(t1 - t0)
            engine_s.append(t2 - t1)
            rtt_s.append(time.perf_counter() - t2)
        worker.shutdown()
    finally:
        stop_engine(proc)
    med = statistics.median
    print(
        f"push: llama of {params / 1e6:.1f}M parameters (float32, {full_bytes / 1e6:.1f} MB), LoRA rank {a.rank} "
        f"all-linear ({adapter_bytes / 1e6:.2f} MB of PEFT files), one CPU engine, {a.push_repeats} turns: "
        f"full merged push {med(paired.baseline):.3f} s ({' '.join(f'{t:.3f}' for t in paired.baseline)}), "
        f"adapter push {med(paired.times):.3f} s ({' '.join(f'{t:.3f}' for t in paired.times)}); "
        f"adapter push split: files written {med(write_s) * 1e3:.1f} ms, engine (pause, unload, load, version, "
        f"continue) {med(engine_s) * 1e3:.1f} ms, one HTTP round trip {med(rtt_s) * 1e3:.1f} ms",
        flush=True,
    )
    return {
        "model_params_m": round(params / 1e6, 1),
        "lora_rank": a.rank,
        "full_push_s": round(med(paired.baseline), 4),
        "adapter_push_s": round(med(paired.times), 4),
        "adapter_write_s": round(med(write_s), 4),
        "adapter_engine_s": round(med(engine_s), 4),
        "http_rtt_s": round(med(rtt_s), 4),
        "full_push_mb": round(full_bytes / 1e6, 1),
        "adapter_push_mb": round(adapter_bytes / 1e6, 3),
        "adapter_push_over_full": round(paired.cost, 4),
        "adapter_bytes_over_full": round(adapter_bytes / full_bytes, 4),
    }


def reset_peak_rss() -> None:
    """Linux's peak resident set (VmHWM) starts again from the current one."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def train_side(side: str, model_path: str, rank: int, samples: int) -> None:
    """A train side's process: ``step K`` on stdin -> one train step on turn K's batch -> one
    ``@@ {json}`` line (its seconds, the peak resident set since the model was loaded)."""
    torch.set_num_threads(1)
    worker = actor(model_path, rank if side == "lora" else None)
    vocab = worker.module.config.vocab_size
    reset_peak_rss()
    for line in sys.stdin:
        if not line.startswith("step"):
            break
        turn = int(line.split()[1])
        batch = long_tailed_batch(samples, 64, vocab, seed=turn)
        t0 = time.perf_counter()
        worker.train(turn, batch)
        print("@@ " + json.dumps({"s": time.perf_counter() - t0, "peak": peak_rss()}), flush=True)
    worker.shutdown()


def train_part(a: argparse.Namespace, work: Path, model_path: str) -> dict:
    """LoRA against full fine-tuning: one step each per turn, in a rotating order, each side its
    own process (its peak memory its own)."""
    sides = ("full", "lora")
    procs = {
        s: subprocess.Popen(
            [sys.executable, __file__, "--train-side", s, model_path, str(a.rank), str(a.train_samples)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(work / f"train_{s}.log", "wb"),  # noqa: SIM115
            text=True,
            cwd=REPO,
            env={**os.environ, **CHILD_ENV},
        )
        for s in sides
    }

    def step(side: str, turn: int) -> dict:
        proc = procs[side]
        proc.stdin.write(f"step {turn}\n")
        proc.stdin.flush()
        for line in proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        raise RuntimeError(f"train side {side} ended:\n{(work / f'train_{side}.log').read_text()[-3000:]}")

    got: dict[str, list[dict]] = {s: [] for s in sides}
    try:
        for turn in range(a.train_turns + 1):  # turn 0: the warm-up, left out
            for side in sides[turn % 2 :] + sides[: turn % 2]:
                got[side].append(step(side, turn))
            print(f"train turn {turn}: " + ", ".join(f"{s} {got[s][-1]['s']:.2f} s" for s in sides), flush=True)
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(120)
    kept = {s: got[s][1:] for s in sides}
    secs = {s: statistics.median(r["s"] for r in kept[s]) for s in sides}
    peak = {s: max(r["peak"] for r in got[s]) for s in sides}
    ratio = statistics.median(lo["s"] / fu["s"] for lo, fu in zip(kept["lora"], kept["full"]))
    print(
        f"train: {a.train_samples} samples a step (prompt 16-48 + response <= 64 tokens), one torch thread each, "
        f"{a.train_turns} turns after one warm-up: full {secs['full']:.2f} s, peak {peak['full'] / 1e6:.0f} MB; "
        f"LoRA rank {a.rank} {secs['lora']:.2f} s, peak {peak['lora'] / 1e6:.0f} MB",
        flush=True,
    )
    return {
        "full_step_s": round(secs["full"], 3),
        "lora_step_s": round(secs["lora"], 3),
        "full_peak_mb": round(peak["full"] / 1e6),
        "lora_peak_mb": round(peak["lora"] / 1e6),
        "lora_step_time_over_full": round(ratio, 4),
        "lora_peak_mem_over_full": round(peak["lora"] / peak["full"], 4),
    }


def fleet_part(a: argparse.Namespace, work: Path) -> dict:
    """K LoRA runs on one fleet, on K fleets, on one engine (the module docstring's fleet)."""
    model = str(build_tiny_model(work / "tiny", TinyModelConfig()))
    key = new_key(work / "engine_key")
    paths = [adapter_dir(model, work / f"adapter{k}", k) for k in range(a.runs)]
    flags = LoraServing(RANK, ("all",), max_loras_per_batch=max(8, a.runs + 1)).flags()
    engines = [start_server(model, work, f"e{i}", flags, key_path=work / "engine_key") for i in range(a.runs)]
    urls = [u for _, u, _ in engines]
    try:

        def once(way: str) -> float:
            threads = []
            for k in range(a.runs):
                mine = {"shared": urls, "separate": [urls[k]], "one_engine": urls[:1]}[way]
                clients = [EngineClient(u, api_key=key, adapter=f"run{k}") for u in mine]
                threads.append(threading.Thread(target=run_loop, args=(clients, f"run{k}", paths[k], a, 1000 * k)))
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            wall = time.perf_counter() - t
            for u in urls:  # each way starts with no adapter loaded
                c = EngineClient(u, api_key=key)
                for k in range(a.runs):
                    try:
                        c.unload_lora_adapter(f"run{k}")
                    except Exception:  # not loaded on this engine (K fleets)
                        pass
            return a.runs * a.rollouts / wall

        rates: dict[str, list[float]] = {"shared": [], "separate": [], "one_engine": []}
        for way in rates:  # warm each way up
            once(way)
        for _ in range(a.repeats):
            for way, got in rates.items():
                got.append(once(way))
    finally:
        for proc, _, _ in engines:
            stop_server(proc)
    out = {
        "runs": a.runs,
        "engines": a.runs,
        "rollouts_per_run": a.rollouts,
        "samples": a.prompts * a.samples,
        "max_new_tokens": a.max_new_tokens,
        "train_s": a.train_s,
        "shared_rollouts_per_s": round(statistics.median(rates["shared"]), 3),
        "separate_rollouts_per_s": round(statistics.median(rates["separate"]), 3),
    }
    out["one_engine_rollouts_per_s"] = round(statistics.median(rates["one_engine"]), 3)
    out["shared_over_separate"] = round(out["shared_rollouts_per_s"] / out["separate_rollouts_per_s"], 2)
    out["one_engine_over_separate"] = round(out["one_engine_rollouts_per_s"] / out["separate_rollouts_per_s"], 2)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--train-side":
        side, model_path, rank, samples = sys.argv[2:6]
        train_side(side, model_path, int(rank), int(samples))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", choices=("push", "train", "fleet"), default=["push", "train", "fleet"])
    p.add_argument("--model-mb", type=float, default=440, help="push, train: float32 model size (440: 108M params)")
    p.add_argument("--rank", type=int, default=16, help="push, train: the adapter's rank")
    p.add_argument("--push-repeats", type=int, default=5, help="push: turns of (full push, adapter push)")
    p.add_argument("--train-turns", type=int, default=3, help="train: turns of (full step, LoRA step), after a warm-up")
    p.add_argument("--train-samples", type=int, default=8, help="train: samples a step")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--train-s", type=float, default=0.2)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rlhpc-bench-lora-"))
    out: dict = {}
    try:
        if {"push", "train"} & set(a.parts):
            model_path = str(build_tiny_model(work / "big", tiny_config(a.model_mb)))
        if "push" in a.parts:
            out.update(push_part(a, work, model_path))
        if "train" in a.parts:
            out.update(train_part(a, work, model_path))
        if "fleet" in a.parts:
            out.update(fleet_part(a, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
