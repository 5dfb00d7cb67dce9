"""GPU check of the megatron actor + engine path on one GPU, colocated, without Ray or Slurm.

One process holds a ``MegatronTrainWorker`` (bf16, distributed optimizer, NCCL world of one)
and drives an engine server on the same GPU over SGLang's HTTP protocol: the CPU engine server
with ``--device cuda`` here, where SGLang is not installed. Each rollout does what the driver
does in colocate + offload mode: generate on the toy task, release the engine's memory, onload
the actor, train, offload it, resume the engine, push the new weights over CUDA IPC. Then a
torch_dist checkpoint is saved twice (the loop waits for the snapshot only) and loaded back.
Prints the start-up phases (engine and actor started together: the job does that where they do
not share GPUs; this engine server reserves no GPU memory up front, so here they can), per-phase
times, tokens/s and memory, the CUDA IPC push timed in turns with a device-to-device copy of the
same bytes, the memory plan's estimate for the actor rank beside the actor's measured peak, and
ends with one JSON line of these figures.

    python tools/gpu_check.py [--rollouts 6] [--hidden 1024] [--layers 8]

Exits non-zero if anything is off: weights on the engine differ from the actor's, offload does
not free memory, the checkpoint does not restore the weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlhpc.actor.megatron.worker import MegatronTrainWorker
from rlhpc.actor.spec import ActorSpec
from rlhpc.cluster.memory import ModelShape, actor_estimate
from rlhpc.config import Config
from rlhpc.data.tasks import TASKS
from rlhpc.model import TinyModelConfig, build_tiny_model, load_tokenizer
from rlhpc.rollout.build import build_generation
from rlhpc.rollout.generation import one_batch
from rlhpc.util.net import http_url
from rlhpc.wire.client import EngineClient

log = logging.getLogger("gpu_check")
GiB = 2**30


def launch_engine(model_path: str, work: Path, device: str) -> subprocess.Popen:
    """The engine server process, started; ``wait_engine`` waits for it to serve."""
    logf = open(work / "engine.log", "wb")  # noqa: SIM115 - open as long as the server runs
    return subprocess.Popen(
        [sys.executable, "-m", "rlhpc.engine_server.cpu", "--model-path", model_path, "--port", "0"]
        + ["--ready-file", str(work / "engine.ready.json"), "--parent-pid", str(os.getpid())]
        + ["--device", device, "--threads", "4"],
        stdout=logf,
        stderr=subprocess.STDOUT,
    )


def wait_engine(proc: subprocess.Popen, work: Path) -> EngineClient:
    ready = work / "engine.ready.json"
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"engine did not start:\n{(work / 'engine.log').read_text()[-3000:]}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    client = EngineClient(http_url(info["host"], info["port"]))
    client.wait_healthy(60)
    return client


def gpu_gib() -> str:
    if not torch.cuda.is_available():
        return "on the CPU"
    return f"{torch.cuda.memory_allocated() / GiB:.2f} GiB allocated by the actor"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=6)
    p.add_argument("--prompts", type=int, default=64, help="prompts per rollout")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--arch", choices=["qwen2", "llama", "qwen3", "qwen3_moe"], default="qwen2")
    p.add_argument("--experts", type=int, default=8, help="qwen3_moe: routed experts per layer (2 per token)")
    p.add_argument("--fp32", action="store_true", help="fp32 params instead of bf16 (+ fp32 master weights)")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--cpu", action="store_true", help="rehearse the script on a CPU (no offload check)")
    p.add_argument("--push-turns", type=int, default=10, help="turns of a push and a device copy of its bytes")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if not torch.cuda.is_available() and not args.cpu:
        sys.exit("no GPU visible: this check is for a GPU machine (--cpu rehearses it on a CPU)")
    work = args.work or Path(tempfile.mkdtemp(prefix="rlhpc-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    tiny = TinyModelConfig(
        architecture=args.arch,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=256,
        num_experts=args.experts,
        num_experts_per_tok=2,
        moe_intermediate_size=args.hidden // 2,
    )
    model_path = str(build_tiny_model(work / "model", tiny))

    cfg = Config()
    cfg.cluster.colocate = cfg.cluster.offload = True
    cfg.actor.backend = "megatron"
    cfg.actor.lr = 1e-5
    cfg.actor.micro_batch_size = 128
    cfg.actor.megatron.bf16 = not args.fp32
    cfg.actor.megatron.use_distributed_optimizer = args.distributed_optimizer
    cfg.rollout.n_samples_per_prompt = args.samples
    cfg.rollout.max_new_tokens = args.max_new_tokens

    start = time.perf_counter()
    engine_proc = launch_engine(model_path, work, "cpu" if args.cpu else "cuda")
    try:
        run(cfg, tiny, model_path, engine_proc, start, args, work)
    finally:
        engine_proc.terminate()
        engine_proc.wait(30)


def run(
    cfg: Config,
    tiny: TinyModelConfig,
    model_path: str,
    engine_proc: subprocess.Popen,
    start: float,
    args: argparse.Namespace,
    work: Path,
) -> None:
    phases: dict[str, float] = {}  # start-up, seconds since the engine was launched

    def phase_done(name: str) -> None:
        phases[name] = time.perf_counter() - start

    # the actor is built while the engine process loads its model (it reserves no memory up front)
    actor = MegatronTrainWorker(ActorSpec.from_config(cfg), model_path, 0, 1)
    actor.init_process_group(actor.rendezvous(one_node=True))
    phase_done("actor_up")
    params = sum(p.numel() for p in actor.gpt.parameters())
    log.info("actor up: %.1fM params, %s", params / 1e6, gpu_gib())
    engine = wait_engine(engine_proc, work)
    phase_done("engine_up")
    actor.connect_rollout([engine.base_url], [1], colocate=True)
    phase_done("weight_channel")
    if err := actor.update_weights(0):
        sys.exit(f"FAIL: weight push: {err}")
    phase_done("first_push")

    task = TASKS["digit_sum"]
    rows = task.make(args.prompts * args.rollouts, random.Random(0))
    # The driver's generation step (requests, seeds, rewards, advantages), all in one /generate batch.
    generation = build_generation(cfg, load_tokenizer(model_path), one_batch(engine), reward=task.reward)
    figures = []
    longest_prompt = 0
    for rollout_id in range(args.rollouts):
        batch_rows = rows[rollout_id * args.prompts : (rollout_id + 1) * args.prompts]
        t = time.perf_counter()
        batch, rollout_metrics, _ = generation.rollout(rollout_id, batch_rows)
        t_gen = time.perf_counter() - t
        ids, responses = batch.prompt_ids, batch.response_ids
        longest_prompt = max(longest_prompt, *(len(i) for i in ids))

        t = time.perf_counter()
        engine.release_memory_occupation()
        actor.onload()
        on = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        t_switch_in = time.perf_counter() - t
        t = time.perf_counter()
        metrics = actor.train(rollout_id, batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t_train = time.perf_counter() - t
        t = time.perf_counter()
        actor.offload()
        off = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        engine.resume_memory_occupation()
        t_switch_out = time.perf_counter() - t
        t = time.perf_counter()
        if err := actor.update_weights(rollout_id + 1):
            sys.exit(f"FAIL: weight push: {err}")
        t_sync = time.perf_counter() - t
        gen_tokens = sum(len(r) for r in responses)
        figures.append(
            {
                "rollout": rollout_id,
                "reward": rollout_metrics["reward"],
                "generate_s": t_gen,
                "gen_tokens_per_s": gen_tokens / t_gen,
                "train_s": t_train,
                "train_tokens_per_s": metrics["tokens"] / t_train,
                "train_all_tokens_per_s": sum(len(a) + len(b) for a, b in zip(ids, responses)) / t_train,
                "sync_s": t_sync,
                "switch_s": t_switch_in + t_switch_out,
                "actor_gib_onloaded": on / GiB,
                "actor_gib_offloaded": off / GiB,
                "rollout_logprob_abs_diff": metrics["rollout_logprob_abs_diff"],
            }
        )
        log.info("rollout %d: %s", rollout_id, json.dumps({k: round(v, 4) for k, v in figures[-1].items()}))
        if rollout_id == 0:
            phase_done("first_rollout")

    # The actor's peak over the rollouts (this process holds only the actor; the engine is another
    # process), against the dry run's memory plan for one actor rank with this run's longest prompt.
    plan_cfg = copy.deepcopy(cfg)
    plan_cfg.data.max_prompt_tokens = longest_prompt
    estimate = actor_estimate(plan_cfg, ModelShape.from_tiny(tiny))
    peak = torch.cuda.max_memory_allocated() if not args.cpu else None

    # The colocated push (actor onloaded) in turns with a device-to-device copy of the same bytes.
    actor.onload()
    mine = actor.named_tensors()  # the weights every push below sends (nothing trains in between)
    sent = sum(t.numel() * t.element_size() for t in mine.values())
    device = torch.device("cpu" if args.cpu else "cuda")
    src, dst = torch.empty(sent, dtype=torch.uint8, device=device), torch.empty(sent, dtype=torch.uint8, device=device)
    version = args.rollouts
    pushes, copies = [], []
    for turn in range(args.push_turns + 1):  # the first turn warms both up
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        copy_s = time.perf_counter() - t
        version += 1
        t = time.perf_counter()
        if err := actor.update_weights(version):
            sys.exit(f"FAIL: weight push: {err}")
        push_s = time.perf_counter() - t
        if turn:
            pushes.append(push_s)
            copies.append(copy_s)
    del src, dst
    push_vs_copy = statistics.median(c / p for c, p in zip(copies, pushes))

    # The engine holds the actor's weights (the smallest tensors, exactly).
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight"):
        got = torch.tensor(engine.get_weights_by_name(name, truncate_size=10**9))
        want = mine[name].float()
        if not torch.equal(got.float(), want):
            sys.exit(f"FAIL: engine weight {name} differs from the actor's after sync")
    if engine.get_weight_version() != str(version):
        sys.exit(f"FAIL: the engine reports weight version {engine.get_weight_version()}, want {version}")
    if not args.cpu and not figures[-1]["actor_gib_offloaded"] < 0.1 * figures[-1]["actor_gib_onloaded"]:
        sys.exit(f"FAIL: offload left {figures[-1]['actor_gib_offloaded']:.2f} GiB on the GPU")

    # torch_dist checkpoint round trip on the GPU: the snapshot is what the loop waits for, the
    # write runs beside training in a job. Twice: the first snapshot allocates its pinned host
    # buffers and starts the persistent writer; the second is what every later save costs.
    saves = []
    for name in ("ckpt0", "ckpt"):
        t = time.perf_counter()
        actor.snapshot(str(work / name))
        t_block = time.perf_counter() - t
        actor.write_snapshot()
        saves.append((t_block, time.perf_counter() - t))
    shutil.rmtree(work / "ckpt0")  # a large model's two checkpoints would fill a small disk
    (first_block, first_save), (t_block, t_save) = saves
    before = actor.state_fingerprint()
    actor.train(args.rollouts, batch)  # move away from the saved weights
    t = time.perf_counter()
    actor.load(str(work / "ckpt"))
    t_load = time.perf_counter() - t
    if actor.state_fingerprint() != before:
        sys.exit("FAIL: the checkpoint did not restore the weights")
    size = sum(f.stat().st_size for f in (work / "ckpt").rglob("*") if f.is_file())
    actor.shutdown()

    steady = figures[1:] or figures
    mean = {k: sum(f[k] for f in steady) / len(steady) for k in steady[0] if k != "rollout"}
    device = "CPU rehearsal" if args.cpu else torch.cuda.get_device_name()
    print("\n== rlhpc GPU check:", device, f"torch {torch.__version__} ==")
    precision = "fp32" if args.fp32 else "bf16 + fp32 master weights"
    optimizer = "distributed" if args.distributed_optimizer else "plain"
    print(f"model: {args.arch} {params / 1e6:.1f}M params, {precision}, {optimizer} optimizer, colocated")
    print(f"per rollout ({args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} new tokens), "
          f"mean of rollouts 1..{args.rollouts - 1}:")  # fmt: skip
    print(f"  generate        {mean['generate_s']:.3f} s  ({mean['gen_tokens_per_s']:.0f} tokens/s, HF engine on GPU)")
    print(f"  train step      {mean['train_s']:.3f} s  ({mean['train_all_tokens_per_s']:.0f} tokens/s incl. prompts)")
    print(f"  weight sync     {mean['sync_s']:.3f} s  (CUDA IPC, {sent / 2**20:.0f} MiB, the actor offloaded)")
    print(f"  offload/onload  {mean['switch_s']:.3f} s  (actor {mean['actor_gib_onloaded']:.2f} GiB -> "
          f"{mean['actor_gib_offloaded']:.3f} GiB)")  # fmt: skip
    print(f"  |actor - engine logprob| {mean['rollout_logprob_abs_diff']:.4f} per token (actor vs fp32 engine)")
    print(
        f"push, actor onloaded: {statistics.median(pushes):.4f} s against {statistics.median(copies):.4f} s for a "
        f"device-to-device copy of the same {sent / 2**20:.0f} MiB ({args.push_turns} turns): "
        f"{push_vs_copy:.2f}x the copy's speed"
    )
    print(
        f"checkpoint: save {t_save:.2f} s (the loop blocked {t_block:.3f} s of it: snapshot to host; the first "
        f"save {first_save:.2f} s, blocked {first_block:.3f} s), load {t_load:.2f} s, {size / 2**20:.0f} MiB "
        "(torch_dist)"
    )
    print("start-up, s since the engine was launched: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    print(f"actor memory, GiB: the plan's estimate {estimate.total / GiB:.2f} per rank (" + ", ".join(
        f"{name} {b / GiB:.2f}" for name, b in estimate.terms) + "), measured peak " + (
        f"{peak / GiB:.2f} (torch.cuda.max_memory_allocated of the actor's process: no CUDA context or NCCL)"
        if peak is not None else "not measured on the CPU"))  # fmt: skip
    print("OK: engine weights == actor weights, offload frees the actor's memory, checkpoint restores")
    summary = {
        "ipc_push_vs_d2d_copy": push_vs_copy,
        "push_s": statistics.median(pushes),
        "d2d_copy_s": statistics.median(copies),
        "save_block_fraction": t_block / t_save,
        "save_blocked_s": t_block,
        "save_s": t_save,
        "load_s": t_load,
        "train_s": mean["train_s"],
        "generate_s": mean["generate_s"],
        **{f"startup_{k}_s": v for k, v in phases.items()},
        "actor_estimate_gib": estimate.total / GiB if not args.cpu else None,
        "actor_peak_gib": peak / GiB if peak is not None else None,
    }
    print(
        json.dumps({k: v if v is None else round(v, 6) for k, v in summary.items()})
    )  # microseconds: a small copy takes tens


if __name__ == "__main__":  # dist_checkpointing starts a spawn Manager: the guard is required
    main()
