#!/usr/bin/env python3
"""FP8 rollout's push against bf16's: bytes and time for the same model, side by side.

This process plays actor rank 0 with a tiny-architecture Llama made ``--model-mb`` big (its
projections multiples of 128, as block FP8 needs) in bf16, the trainer's dtype on a GPU. Two
real CPU engine servers: one on the model in bf16, one on its block-FP8 copy
(``rlhpc.weights.fp8.write_checkpoint``). Each push is the loop's: the HF-named tensors through
``DistributedWeightSender`` (gloo broadcast, disaggregated) or ``TensorWeightSender`` (shared
memory, colocated); the FP8 push quantizes on the way (``quantized_named``), its time includes
the quantization. Timed in turns (bf16, fp8, bf16, ...), one warm-up each, the median printed.
On CPU the quantization is compute a GPU does far faster; the bytes are what carries over.

A third case, "fp8 sent", pushes tensors quantized before the clock starts: what the halved
bytes cost on the wire and in the engine's copy, without the trainer's quantization.

The last line is one JSON object: ``bytes_ratio`` (FP8 push bytes / bf16's), per channel
``<channel>_time_ratio`` (FP8 push time / bf16's; below 1: FP8 is faster) and
``<channel>_sent_time_ratio`` (the pre-quantized push's time / bf16's).

    python tools/bench/fp8_push.py
    python tools/bench/fp8_push.py --model-mb 400 --repeats 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync import start_engine, stop_engine  # noqa: E402 (the sibling bench's engine helpers)

from rlhpc.config import TinyModelConfig  # noqa: E402
from rlhpc.model import build_tiny_model, load_model  # noqa: E402
from rlhpc.weights import fp8  # noqa: E402
from rlhpc.weights.broadcast import DistributedWeightSender  # noqa: E402
from rlhpc.weights.shared_memory import TensorWeightSender  # noqa: E402
from rlhpc.weights.tensor_transport import nbytes  # noqa: E402
from rlhpc.wire.client import EngineClient  # noqa: E402

LAYERS = 4
CASES = ("bf16", "fp8", "fp8 sent")  # the fp8 push quantizing on the way; the same of tensors quantized before


def tiny_config(model_mb: float) -> TinyModelConfig:
    """A Llama of about ``model_mb`` MB in bf16, every projection a multiple of 128."""
    per_h2 = 2 * LAYERS * (2 + 1 + 3 * 4)  # bf16; q,o: H^2 each, k,v: H^2/2 each, MLP 3 x H x 4H
    hidden = max(256, round(math.sqrt(model_mb * 1e6 / per_h2) / 256) * 256)
    return TinyModelConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=LAYERS,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 256),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-mb", type=float, default=200, help="size of the bf16 model (approximate)")
    p.add_argument("--repeats", type=int, default=3, help="timed pushes per case (median printed)")
    p.add_argument("--bucket-mb", type=int, default=64, help="the push's bucket size")
    args = p.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench-fp8-"))
    procs = []
    try:
        path = build_tiny_model(work / "bf16", tiny_config(args.model_mb))
        quantized = fp8.write_checkpoint(path, work / "fp8")
        model = load_model(path).to(torch.bfloat16)
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        urls = {}
        for kind, where in (("bf16", path), ("fp8", quantized)):
            proc, urls[kind] = start_engine(str(where), work, kind)
            procs.append(proc)
        sizes = {
            "bf16": sum(nbytes(t) for _, t in named),
            "fp8": sum(nbytes(t) for _, t in fp8.quantized_named(named)),
        }
        versions = itertools.count(1)
        times: dict[str, dict[str, list[float]]] = {}
        for channel, colocate in (("disaggregated", False), ("colocated", True)):
            bucket = args.bucket_mb << 20
            senders = {  # a broadcast group each (one name would replace the other's group)
                kind: TensorWeightSender([EngineClient(urls[kind])], [1], bucket)
                if colocate
                else DistributedWeightSender(
                    [EngineClient(urls[kind])], [1], "127.0.0.1", "gloo", bucket, group_name=f"bench_fp8_{kind}"
                )
                for kind in urls
            }
            for s in senders.values():
                s.connect()
            times[channel] = {kind: [] for kind in CASES}
            for turn in range(args.repeats + 1):  # turn 0: warm-up
                for kind in CASES:
                    # "fp8 sent": the same push of tensors quantized beforehand: the bytes' own cost
                    ready = list(fp8.quantized_named(named)) if kind == "fp8 sent" else None
                    stream = named if kind == "bf16" else ready or fp8.quantized_named(named)
                    start = time.perf_counter()
                    senders[kind.split()[0]].send(stream, next(versions))
                    if turn:
                        times[channel][kind].append(time.perf_counter() - start)
            for s in senders.values():
                s.close()
        print(f"model: {sizes['bf16'] / 1e6:.0f} MB in bf16, {args.repeats} pushes per case (median)")
        print(f"{'':16}{'bf16':>10}{'fp8':>10}{'fp8 sent':>10}{'fp8/bf16':>10}{'sent/bf16':>10}")
        mb = sizes["bf16"] / 1e6, sizes["fp8"] / 1e6
        print(f"{'push MB':16}{mb[0]:10.1f}{mb[1]:10.1f}{mb[1]:10.1f}{mb[1] / mb[0]:10.3f}{mb[1] / mb[0]:10.3f}")
        result = {"bytes_ratio": round(sizes["fp8"] / sizes["bf16"], 4)}
        for channel, t in times.items():
            a, b, c = (statistics.median(t[k]) for k in CASES)
            print(f"{channel + ' s':16}{a:10.3f}{b:10.3f}{c:10.3f}{b / a:10.3f}{c / a:10.3f}")
            result[f"{channel}_time_ratio"] = round(b / a, 3)
            result[f"{channel}_sent_time_ratio"] = round(c / a, 3)
        result["model_mb_bf16"] = round(sizes["bf16"] / 1e6, 1)
        print(json.dumps(result))
        return 0
    finally:
        for proc in procs:
            stop_engine(proc)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
