#!/usr/bin/env python3
"""The train/inference logprob mismatch with and without routing replay (R3), and with and
without FP8 rollout + TIS, side by side on the same prompts.

Each case samples one rollout from a real CPU engine server through the loop's generation step
(``rlhpc.rollout.build.build_generation``, seeded, so every run samples the same tokens), then
computes the trainer's logprob of every response token as the torch actor does (transformers'
forward of the trained weights in float32; with R3 inside ``rlhpc.moe_routing.replayed``, the
actor's replay; ``tests/integration/test_routing_replay.py`` checks both actors equal it).
Per case: the mismatch, mean |trainer logprob - engine logprob| per token (the loop's
``rollout_logprob_abs_diff``), and the TIS weights min(pi_trainer / pi_engine, algo.tis_clip)
(``rlhpc.algo.grpo.truncated_is_weights``): their spread (std) and the share truncated.

- ``moe`` / ``moe + R3``: a tiny Qwen3-MoE; the engine serves it with noise on every router
  (``--router-noise`` x the router's std), a stand-in for the kernels and precision that make
  SGLang route a share of the tokens elsewhere than megatron (the CPU engine computes in
  float32 as the trainer does here, so it would route alike). Without R3 the trainer routes
  every token itself; with R3 it takes the engine's experts (their weights still from its own
  router, as in the actor).
- ``dense`` / ``dense fp8 + TIS``: a tiny dense Llama whose projections fit 128 x 128 blocks;
  one engine on the model, one on its block-FP8 copy (``rlhpc.weights.fp8.write_checkpoint``,
  what ``rollout.quantization: fp8`` serves). The CPU engine refuses FP8 for MoE models (its
  fused experts are not built in FP8), so FP8 is measured on the dense model.

The last line is one JSON object: ``r3_mismatch_ratio`` (mismatch with R3 / without; below 1:
R3 helps), ``r3_tis_std_ratio`` (the TIS weights' std, the same), and the absolute figures:
``fp8_mismatch`` and ``fp8_tis_weight_std`` against ``dense_mismatch``, the full-precision
engine's (float32 rounding only: the CPU engine and the trainer compute alike, so no ratio to
it is given). Every figure is deterministic for given arguments (seeded models and sampling).

    python tools/bench/mismatch.py
    python tools/bench/mismatch.py --prompts 16 --samples 4 --router-noise 0.3
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync import start_engine, stop_engine  # noqa: E402 (the sibling bench's engine helpers)

from rlhpc.algo.grpo import truncated_is_weights  # noqa: E402
from rlhpc.batch import RolloutBatch  # noqa: E402
from rlhpc.config import AlgoConfig, Config, TinyModelConfig  # noqa: E402
from rlhpc.model import build_tiny_model, load_model, load_tokenizer  # noqa: E402
from rlhpc.moe_routing import UNKNOWN, recorded, replayed  # noqa: E402
from rlhpc.rollout.build import build_generation  # noqa: E402
from rlhpc.rollout.generation import one_batch  # noqa: E402
from rlhpc.weights import fp8  # noqa: E402
from rlhpc.wire import protocol as P  # noqa: E402
from rlhpc.wire.client import EngineClient  # noqa: E402

CASES = ("moe", "moe + R3", "dense", "dense fp8 + TIS")


def noisy_routers(src: Path, dst: Path, scale: float) -> Path:
    """A copy of the MoE model at ``src`` with Gaussian noise of ``scale`` x each router's std."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        w = weights[name]
        weights[name] = w + torch.randn(w.shape, generator=g) * w.std() * scale
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def sample(served: Path, work: Path, name: str, rows: list[dict], args: argparse.Namespace) -> RolloutBatch:
    """One seeded rollout of ``rows`` from a CPU engine server on ``served`` (with each token's
    experts for a MoE model)."""
    moe = (served / "config.json").read_text().count('"qwen3_moe"') > 0
    flags = ["--enable-deterministic-inference"] + ([P.ROUTED_EXPERTS_FLAG] if moe else [])
    proc, url = start_engine(str(served), work, name, flags=flags)
    try:
        cfg = Config(seed=7, deterministic=True)
        cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt = len(rows), args.samples
        cfg.rollout.max_new_tokens, cfg.algo.routing_replay = args.max_new_tokens, moe
        gen = build_generation(
            cfg, load_tokenizer(served), one_batch(EngineClient(url, 600)), reward=lambda p, r, a: 0.0,
            model_path=str(served) if moe else None,
        )  # fmt: skip
        batch, _, _ = gen.rollout(0, rows)
        return batch
    finally:
        stop_engine(proc)


def trainer_logprobs(model: torch.nn.Module, batch: RolloutBatch, replay: bool) -> tuple[list[float], float]:
    """Each response token's logprob under ``model`` (routers replaying the engine's experts
    when ``replay``), flattened; and for a MoE model the share of the engine's routed
    (token, layer) pairs the trainer's own routers would have sent elsewhere."""
    out, differ, pairs = [], 0, 0
    for k, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        ids = torch.tensor([p + r])
        experts = None
        if batch.routed_experts:
            given = batch.routed_experts[k].long()  # every token but the last: that one samples nothing
            experts = torch.cat([given, torch.full((1, *given.shape[1:]), UNKNOWN)])
        with torch.no_grad(), recorded(model) as own, replayed(model, experts if replay else None):
            lps = model(ids).logits[0, :-1].log_softmax(-1)
        if experts is not None and not replay:
            mine = own[-1][:-1].sort(-1).values
            differ += int((mine != given.sort(-1).values.to(mine.dtype)).any(-1).sum())
            pairs += mine.shape[0] * mine.shape[1]
        out += lps[len(p) - 1 :].gather(-1, torch.tensor(r)[:, None])[:, 0].tolist()
    return out, differ / pairs if pairs else 0.0


def figures(trainer: list[float], engine: list[float], clip: float) -> dict[str, float]:
    t, e = torch.tensor(trainer), torch.tensor(engine)
    weights, clipped = truncated_is_weights(t, e, torch.ones_like(t), clip)
    return {
        "mismatch": float((t - e).abs().mean()),
        "max_abs_diff": float((t - e).abs().max()),
        "tis_weight_std": float(weights.std()),
        "tis_weight_mean": float(weights.mean()),
        "tis_clipfrac": float(clipped),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="prompts, the same for every case")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--router-noise", type=float, default=0.1, help="the engine's router noise, x each router's std")
    args = p.parse_args()
    torch.set_num_threads(1)
    clip = AlgoConfig().tis_clip
    rows = [{"prompt": f"{i}*{i + 3}=", "answer": str(i * (i + 3))} for i in range(args.prompts)]
    work = Path(tempfile.mkdtemp(prefix="bench-mismatch-"))
    try:
        moe = build_tiny_model(work / "moe", TinyModelConfig(architecture="qwen3_moe", seed=3))
        dense = build_tiny_model(work / "dense", TinyModelConfig(hidden_size=256, intermediate_size=256))
        served = {
            "moe": noisy_routers(moe, work / "moe_served", args.router_noise),
            "dense": dense,
            "dense fp8": fp8.write_checkpoint(dense, work / "dense_fp8"),
        }
        batches = {name: sample(path, work, name.replace(" ", "_"), rows, args) for name, path in served.items()}
        results, routed_elsewhere = {}, 0.0
        for case in CASES:
            kind = "moe" if case.startswith("moe") else "dense"
            batch = batches["dense fp8" if "fp8" in case else kind]
            lps, share = trainer_logprobs(load_model(moe if kind == "moe" else dense), batch, "R3" in case)
            routed_elsewhere = max(routed_elsewhere, share)
            results[case] = figures(lps, [x for xs in batch.rollout_logprobs for x in xs], clip)
        tokens = {k: sum(len(r) for r in b.response_ids) for k, b in batches.items()}
        print(
            f"{args.prompts} prompts x {args.samples} samples, up to {args.max_new_tokens} tokens "
            f"(response tokens: moe {tokens['moe']}, dense {tokens['dense']}, fp8 {tokens['dense fp8']}); "
            f"the MoE engine routes {routed_elsewhere:.1%} of (token, layer) pairs elsewhere than the trainer; "
            f"TIS clip {clip}"
        )
        print(f"{'case':18}{'mismatch':>12}{'max |diff|':>12}{'TIS std':>10}{'TIS mean':>10}{'clipped':>9}")
        for case, f in results.items():
            print(
                f"{case:18}{f['mismatch']:12.3e}{f['max_abs_diff']:12.3e}{f['tis_weight_std']:10.4f}"
                f"{f['tis_weight_mean']:10.4f}{f['tis_clipfrac']:9.4f}"
            )
        moe_plain, moe_r3 = results["moe"], results["moe + R3"]
        full, quant = results["dense"], results["dense fp8 + TIS"]
        print(
            json.dumps(
                {
                    "r3_mismatch_ratio": round(moe_r3["mismatch"] / moe_plain["mismatch"], 4),
                    "r3_tis_std_ratio": round(moe_r3["tis_weight_std"] / moe_plain["tis_weight_std"], 4),
                    "moe_mismatch": float(f"{moe_plain['mismatch']:.4g}"),
                    "moe_r3_mismatch": float(f"{moe_r3['mismatch']:.4g}"),
                    "dense_mismatch": float(f"{full['mismatch']:.4g}"),
                    "fp8_mismatch": float(f"{quant['mismatch']:.4g}"),
                    "fp8_tis_weight_std": float(f"{quant['tis_weight_std']:.4g}"),
                    "routed_elsewhere": round(routed_elsewhere, 4),
                }
            )
        )
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
