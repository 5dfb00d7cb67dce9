"""Rollout routing replay (R3, ``algo.routing_replay``) end to end on CPU: a CPU engine serving a
tiny Qwen3-MoE whose routers are perturbed (so it routes tokens elsewhere than the trainer's
model would) answers each token's experts; the rollout carries them (checkpoint state, dump);
both actors replay them, and their logprobs become those of the trainer's weights under the
engine's routing, computed here by hand with transformers (routers forced).

Cost: one engine server, a torch actor of one rank and a megatron actor of two (EP=2), four
tiny trainings each."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from support.actors import Group
from support.engines import engine_client, start_server, stop_server
from transformers import AutoModelForCausalLM

from rlhpc.batch import RolloutBatch
from rlhpc.config import AlgoConfig, Config, EvalConfig, RolloutConfig
from rlhpc.engine_server.cpu.requests import normalize_generate
from rlhpc.engine_server.cpu.runner import Engine
from rlhpc.metrics import write_rollout_dump
from rlhpc.model import TinyModelConfig, build_tiny_model, load_tokenizer, routing_shape
from rlhpc.rollout.generation import Generation, one_batch
from rlhpc.wire import protocol as P

pytestmark = pytest.mark.ray

ROWS = [{"prompt": f"{i}*{i + 3}=", "answer": str(i * (i + 3))} for i in range(4)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The model the actor trains, and the same with noise on every router (the engine's)."""
    root = tmp_path_factory.mktemp("r3")
    trained = build_tiny_model(root / "trained", TinyModelConfig(architecture="qwen3_moe", seed=3))
    served = root / "served"
    shutil.copytree(trained, served)
    weights = load_file(served / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        w = weights[name]
        weights[name] = w + torch.randn(w.shape, generator=g) * w.std()
    save_file(weights, served / "model.safetensors", metadata={"format": "pt"})
    return str(trained), str(served)


@pytest.fixture(scope="module")
def rollout(models: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutBatch]:
    """One rollout (4 prompts x 2 samples) from a CPU engine serving the perturbed model, with
    the flag, through the generation step as the driver runs it."""
    work = tmp_path_factory.mktemp("srv")
    proc, url, _ = start_server(models[1], work, "engine", [P.ROUTED_EXPERTS_FLAG])
    try:
        rollout_cfg = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=2, max_new_tokens=6)
        gen = Generation(
            load_tokenizer(models[1]), lambda p, r, a: float(len(r) % 2), rollout_cfg, EvalConfig(),
            AlgoConfig(routing_replay=True), 7, one_batch(engine_client(url, timeout_s=120)),
            routing_shape=routing_shape(models[1]),
        )  # fmt: skip
        batch, _, _ = gen.rollout(0, ROWS)
    finally:
        stop_server(proc)
    yield batch


def routing_of(model_path: str, ids: list[int]) -> np.ndarray:
    """transformers' own top-k of each router for ``ids`` (one forward), [tokens, layers, k], sorted."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return np.sort(np.stack([torch.topk(x.float().softmax(-1), k).indices.numpy() for x in logits], 1), -1)


def test_the_engine_answers_the_experts_its_forward_chose(
    models: tuple[str, str], rollout: RolloutBatch, tmp_path: Path
) -> None:
    """Every prompt and output token but the last, per layer, as SGLang answers them: the same
    as transformers routes them in one forward of the served model; kept through a checkpoint's
    pending rollouts and the HDF5 dump. An engine started without the flag ignores the request's
    field (SGLang's behaviour: no capturer, no answer)."""
    assert len(rollout.routed_experts) == len(rollout) == 8
    for p, r, experts in zip(rollout.prompt_ids, rollout.response_ids, rollout.routed_experts):
        assert experts.dtype == torch.uint8 and experts.shape == (len(p) + len(r) - 1, 2, 2)
        assert (np.sort(experts.numpy(), -1) == routing_of(models[1], (p + r)[:-1])).all()
    # the trainer's model routes a share of them elsewhere: what replay is for
    differ = [(np.sort(e.numpy(), -1) != routing_of(models[0], (p + r)[:-1])).any(-1).mean()
              for p, r, e in zip(rollout.prompt_ids, rollout.response_ids, rollout.routed_experts)]  # fmt: skip
    assert np.mean(differ) > 0.05

    again = RolloutBatch.from_state_dict(torch.load(_saved(rollout, tmp_path), weights_only=True))
    assert all(torch.equal(a, b) for a, b in zip(again.routed_experts, rollout.routed_experts))
    write_rollout_dump(tmp_path / "dump.h5", 0, rollout, {})
    with h5py.File(tmp_path / "dump.h5") as f:
        shape = tuple(f.attrs["routed_experts_shape"])
        assert (f["routed_experts"][3].reshape(-1, *shape) == rollout.routed_experts[3].numpy()).all()

    engine = Engine(models[1], "0")  # no --enable-return-routed-experts
    items, _ = normalize_generate(
        {"input_ids": rollout.prompt_ids[0], "return_routed_experts": True, "sampling_params": {"max_new_tokens": 2}},
        engine.limits,
        engine.tokenizer.encode,
    )
    assert P.MetaInfo.ROUTED_EXPERTS not in engine.generate(items, engine.next_seq())[0]["meta_info"]


def _saved(batch: RolloutBatch, tmp_path: Path) -> Path:
    path = tmp_path / "pending.pt"
    torch.save(batch.state_dict(), path)
    return path


def logprobs_by_hand(model_path: str, batch: RolloutBatch, forced: bool) -> list[list[float]]:
    """Each response token's logprob under ``model_path``, its routers forced to the batch's
    routing when ``forced``: each router's forward replaced by one that takes the given experts
    and weighs them by its own softmax, renormalised (Qwen3-MoE's norm_topk_prob)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    routers = [layer.mlp.gate for layer in model.model.layers]
    out = []
    for p, r, experts in zip(batch.prompt_ids, batch.response_ids, batch.routed_experts):
        ids = p + r
        for k, router in enumerate(routers):
            if forced:
                given = torch.cat([experts[:, k].long(), torch.zeros(1, experts.shape[-1], dtype=torch.long)])

                def forward(h, router=router, given=given):
                    logits = torch.nn.functional.linear(h.reshape(-1, router.hidden_dim), router.weight)
                    w = logits.softmax(-1, dtype=torch.float).gather(-1, given)
                    return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), given

                router.forward = forward
            else:
                router.__dict__.pop("forward", None)
        with torch.no_grad():
            lps = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        out.append(lps[len(p) - 1 :].gather(-1, torch.tensor(r)[:, None])[:, 0].tolist())
    return out


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = [(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    return sum(abs(x - y) for x, y in pairs) / len(pairs)


@pytest.mark.parametrize(("backend", "ranks"), [("torch", 1), ("megatron", 2)], ids=["torch", "megatron-ep2"])
def test_replay_makes_the_trainers_logprobs_those_of_the_engines_routing(
    ray_cluster: None, models: tuple[str, str], rollout: RolloutBatch, backend: str, ranks: int
) -> None:
    """The actor's old-policy logprobs (``rollout_logprob_abs_diff`` = their mean distance to the
    rollout's logprobs, over the first step's training forward and the second's no-grad pass;
    lr 0, so every training sees the same weights) with and without the routing: against the
    engine's logprobs the mismatch falls with replay, to what transformers computes under the
    engine's routing; against those hand-computed logprobs it is 0 with replay (every token's
    logprob equal) and not without. The megatron actor at EP=2 over two data-parallel ranks:
    each rank's micro-batch padded to the EP group's shape, its routers fed in that shape."""
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    forced = logprobs_by_hand(models[0], rollout, forced=True)
    plain = logprobs_by_hand(models[0], rollout, forced=False)
    by_hand = RolloutBatch(**{**rollout.state_dict(), "rollout_logprobs": forced, "images": []})
    cfg = Config(deterministic=True)
    cfg.actor.backend = backend
    cfg.actor.lr = 0.0
    cfg.actor.micro_batch_size = 3
    cfg.actor.num_steps_per_rollout = 2
    cfg.algo.routing_replay = True
    cfg.actor.megatron.expert_model_parallel_size = ranks

    def without_routing(batch: RolloutBatch) -> RolloutBatch:
        return RolloutBatch(**{**batch.state_dict(), "routed_experts": [], "images": []})

    with Group(cfg, models[0], ranks) as g:
        diff = [
            g.train(k, b)["rollout_logprob_abs_diff"]
            for k, b in enumerate([rollout, without_routing(rollout), by_hand, without_routing(by_hand)])
        ]
    assert diff[0] == pytest.approx(mean_abs_diff(forced, rollout.rollout_logprobs), rel=1e-4)
    assert diff[1] == pytest.approx(mean_abs_diff(plain, rollout.rollout_logprobs), rel=1e-4)
    assert diff[0] < diff[1]
    assert diff[2] < 1e-5 < 1e-3 < diff[3]
