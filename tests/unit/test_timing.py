"""The step-time estimate (rlhpc/cluster/timing.py): the published models' active parameters, each
phase on one shape worked by hand, how the layout moves each phase, and the fastest layout the
dry run suggests being one a submission accepts."""

import json
import typing
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhpc.cluster import timing
from rlhpc.cluster.memory import ModelShape, check_fits, read_shape
from rlhpc.cluster.timing import GPUS, Assumptions, active_params, candidates, estimate
from rlhpc.config import ClusterConfig, check_parallelism, check_run
from rlhpc.preflight import load_config

MODELS = Path(__file__).resolve().parents[1] / "support" / "models"


def shape_of(model: str) -> ModelShape:
    return ModelShape.from_hf(json.loads((MODELS / model / "config.json").read_text()))


def test_the_config_names_every_kind_of_the_table():
    literal, none = typing.get_args(typing.get_type_hints(ClusterConfig)["gpu_kind"])
    assert none is type(None) and set(typing.get_args(literal)) == set(GPUS)


def test_active_parameters_of_the_published_models():
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B of them active (its model card); a dense model's are all
    moe = shape_of("qwen3-30b-a3b")
    assert round(moe.params() / 1e9, 1) == 30.5 and round(active_params(moe) / 1e9, 1) == 3.4
    dense = shape_of("qwen3-8b")
    assert dense.params() - active_params(dense) == dense.hidden  # all but the final norm


# The tiny qwen3 of test_memory (2 layers, hidden 64, ffn 256, vocab 320, untied): 164160 active
# parameters; 4 prompts x 8 samples of 32 + 96 tokens; megatron in bf16 on 4 GPUs, 2 engines of TP 1
TINY = [
    "model.tiny.architecture=qwen3", "cluster.gpus_per_node=8", "cluster.actor_num_gpus=4", "cluster.rollout_num_gpus=2",
    "rollout.backend=sglang", "actor.backend=megatron", "actor.megatron.bf16=true", "data.max_prompt_tokens=32",
    "rollout.max_new_tokens=96", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=8",
    "cluster.gpu_kind=H100",
]  # fmt: skip


def tiny(*more: str):
    return load_config("jobs/configs/embedded.yaml", [*TINY, *more])


def test_each_phase_on_one_shape_by_hand():
    cfg = tiny()
    shape, h100, a = read_shape(cfg), GPUS["H100"], Assumptions()
    assert active_params(shape) == 2 * (61440 + 160) + 2 * 320 * 64 == 164160
    t = estimate(cfg, h100, shape, a)
    # training: 32 x 128 = 4096 tokens, 4 passes (old logprobs, forward, backward twice), 2
    # FLOPs per parameter and token, on 4 GPUs at 35% of 989 TFLOP/s
    assert t.train == pytest.approx(2 * 164160 * 4096 * 4 / (4 * 989e12 * 0.35))
    # with the KL's reference: a fifth pass
    assert estimate(tiny("algo.kl_coef=0.1"), h100, shape, a).train == pytest.approx(t.train * 5 / 4)
    # the push: 2 bytes x 164224 parameters (the final norm too) over NVLink at 80%, plus 0.5 s
    assert t.push == pytest.approx(2 * 164224 / (450e9 * 0.8) + 0.5)
    # generation: 16 samples an engine, all at once; a decode step reads the weights (2 bytes x
    # 164160 active) and 16 rows of 32 + 48 tokens' KV cache (2 layers x k, v x 32 x 2 bytes)
    kv = 16 * (32 + 48) * 2 * 2 * 32 * 2
    step = max((2 * 164160 + kv) / (3.35e12 * 0.7), 2 * 164160 * 16 / (989e12 * 0.5)) + 0.003
    prefill = 2 * 164160 * 16 * 32 / (989e12 * 0.5)
    assert t.generate == pytest.approx(prefill + 96 * step)
    assert t.step == pytest.approx(t.generate + t.train + t.push) and not t.overlapped


def test_the_layout_moves_each_phase():
    shape, h100 = read_shape(tiny()), GPUS["H100"]
    base = estimate(tiny(), h100, shape)
    assert estimate(tiny("cluster.actor_num_gpus=2"), h100, shape).train == pytest.approx(2 * base.train)
    # asynchronous: generation beside training, the push after both
    async_ = estimate(tiny("rollout.max_staleness=1"), h100, shape)
    assert async_.overlapped and async_.step == pytest.approx(max(async_.generate, async_.train) + async_.push)
    # the push's link: NVLink on one node, the network across nodes, the GPU's memory colocated
    bytes_ = 2 * shape.params()
    nodes = estimate(tiny("cluster.num_nodes=2", "cluster.gpus_per_node=4"), h100, shape)
    assert nodes.push == pytest.approx(bytes_ / (50e9 * 0.8) + 0.5)
    colocated = estimate(tiny("cluster.colocate=true", "cluster.rollout_num_gpus=4"), h100, shape)
    assert colocated.push == pytest.approx(bytes_ / (3.35e12 / 2 * 0.8) + 0.5)
    # a faster memory makes decoding faster, nothing else
    h200 = estimate(tiny(), GPUS["H200"], shape)
    assert h200.generate < base.generate and h200.train == base.train


def test_the_suggested_layout_is_one_a_submission_accepts_and_the_fastest(tmp_path: Path):
    data = tmp_path / "gsm8k.parquet"
    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}]
    pq.write_table(pa.Table.from_pylist(rows), data)
    sets = [f"model.path={MODELS / 'qwen3-8b'}", f"data.train_file={data}", f"data.eval_file={data}",
            "cluster.gpu_kind=H100"]  # fmt: skip
    cfg = load_config("jobs/configs/gsm8k_qwen3_8b_1x8.yaml", sets)
    shape, h100 = read_shape(cfg), GPUS["H100"]
    found = candidates(cfg)
    assert found and any(c.cluster.colocate for c in found) and any(not c.cluster.colocate for c in found)
    for c in found:  # each passes the rules a submission applies, at the memory the config gives
        check_run(c), check_parallelism(c), check_fits(c)
        assert c.cluster.gpu_memory_gb == (cfg.cluster.gpu_memory_gb or h100.memory_gib)
    best = min(found, key=lambda c: estimate(c, h100, shape).step)
    text = timing.summarize(cfg)
    assert f"fastest layout of these 8 GPUs within memory: {estimate(best, h100, shape).step:.1f} s" in text
    assert timing.describe(best) in text
    # asynchronous generation needs separate GPUs: no colocated layout is offered
    async_ = load_config("jobs/configs/gsm8k_qwen3_8b_1x8.yaml", [*sets, "rollout.max_staleness=1"])
    assert all(not c.cluster.colocate for c in candidates(async_))


def test_without_a_gpu_kind_the_dry_run_says_how_to_get_one():
    assert "set cluster.gpu_kind (one of A100, H100, H200, B200)" in timing.summarize(tiny("cluster.gpu_kind=null"))
