#!/usr/bin/env python3
"""Many LoRA runs, one fleet: rollouts/s of K runs sharing one fleet of K engines against K runs
each on a fleet of one engine (the same engines in all), side by side.

CPU engine servers (the embedded job's tiny model) serving LoRA adapters, as a ``--shared-fleet``
sweep starts them. Each of the K runs is a thread doing what a run's loop does to its engines,
``--rollouts`` times: push its adapter (unload, load its PEFT files: the shared push, no pause),
generate a rollout (``--prompts`` x ``--samples``, each sample its own seed, answers of exactly
``--max-new-tokens`` tokens) naming its adapter, then ``--train-s`` seconds away from the engines
(a stand-in for its training step, a sleep). On one fleet, a run's rollout is spread over every
engine (as the run's fan-out spreads it); on K fleets it goes to its own engine, which idles while
its run trains. A third way: the K runs on a fleet of ONE engine (what a shared fleet saves: K - 1
engines). The ways alternate ``--repeats`` times, so this machine's drift falls on each.

    python tools/bench/lora.py [--runs 2] [--rollouts 4] [--prompts 8] [--samples 4] \\
        [--max-new-tokens 8] [--train-s 0.2] [--repeats 2]

The last line is one JSON object: ``shared_rollouts_per_s`` and ``separate_rollouts_per_s``
(medians over the repeats, all runs' rollouts per wall second), ``shared_over_separate``; and
``one_engine_rollouts_per_s``, ``one_engine_over_separate`` (the same runs on 1 engine against K).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # support.engines: a CPU engine server on a free port

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from support.engines import start_server, stop_server  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--train-s", type=float, default=0.2)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rlhpc-bench-lora-"))
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
    print(json.dumps(out))


if __name__ == "__main__":
    main()
