"""The GPU memory plan (rlhpc/cluster/memory.py): each term on one shape computed by hand, the
refusal naming the biggest term and its knobs, and megatron's own weight + optimizer formula."""

import pytest

from rlhpc.cluster.memory import (
    GIB,
    ModelShape,
    actor_estimate,
    check_fits,
    engine_estimate,
    read_shape,
    stage_estimate,
    summarize,
)
from rlhpc.errors import ConfigError
from rlhpc.preflight import load_config

# The tiny qwen3 (hidden 64, ffn 256, 2 layers, 4 heads of 16, 2 key/value heads, BPE vocab 320)
# on 4 megatron ranks: TP 2, DP 2, bf16, distributed optimizer; micro-batches of 2 samples of
# 32 prompt + 96 new tokens = 2 rows of 128, 256 tokens.
TINY = [
    "model.tiny.architecture=qwen3", "cluster.gpus_per_node=16", "cluster.actor_num_gpus=4", "cluster.rollout_num_gpus=2",
    "rollout.backend=sglang", "cluster.rollout_gpus_per_engine=2", "actor.backend=megatron",
    "actor.megatron.tensor_model_parallel_size=2", "actor.megatron.use_distributed_optimizer=true",
    "actor.megatron.bf16=true", "actor.micro_batch_size=2", "data.max_prompt_tokens=32", "rollout.max_new_tokens=96",
    "rollout.rollout_batch_size=4",
]  # fmt: skip


def tiny(*more: str):
    return load_config("jobs/configs/embedded.yaml", [*TINY, *more])


def test_the_terms_of_one_shape_computed_by_hand():
    cfg = tiny()
    shape = read_shape(cfg)
    # per layer: q 64x64 + k, v 2 x 64x32 + o 64x64 + gate, up, down 3 x 64x256 = 61440 split
    # over TP; 2 norms of 64 + q/k norms of 16 = 160 replicated
    assert shape.layer_params() == (61440, 160, 0)
    # on a rank: 2 x (61440 / 2 + 160) + embedding and output 2 x 512 (320 padded to 128 x TP) x 64 / 2
    # + the final norm 64 = 61760 + 32768 + 64 = 94592
    terms = dict(actor_estimate(cfg, shape).terms)
    assert terms["weights"] == 2 * 94592 == 189184
    assert terms["gradients"] == 4 * 94592 == 378368
    assert terms["optimizer"] == 12 * 94592 / 2 == 567552  # fp32 master + 2 moments over DP 2
    # per token and layer: 4 x 64 + (2 x 64 + 2 x 32) / 2 + 4 x 256 / 2 = 864 values; per row the
    # scores of 4 / 2 heads: 2.5 x 256 x 128 x 2 = 163840; bf16: 2 x (864 x 256 + 163840) = 770048
    assert terms["activations (no recompute)"] == 2 * 770048 == 1540096
    # the logits: bytes per token and vocab entry (kept as a factor, not restated), over the
    # micro-batch's 256 tokens and the TP shard of the padded vocab (at TP 1, 320 padded to 384)
    per_entry = terms["logits"] / (256 * 512 / 2)
    assert per_entry == int(per_entry) >= 2  # at least the bf16 output itself
    tp1 = dict(actor_estimate(tiny("actor.megatron.tensor_model_parallel_size=1"), shape).terms)
    assert tp1["logits"] == terms["logits"] * 384 / (512 / 2)
    # the runtime's allowance is one fixed amount a rank, whatever the shape, layout or batch
    assert tp1["runtime (CUDA, NCCL)"] == terms["runtime (CUDA, NCCL)"] > 0
    # recompute: each layer's input (2 bytes x 64 x 256 tokens) and one whole layer
    recomputed = dict(actor_estimate(tiny("actor.megatron.recompute=true"), shape).terms)
    assert recomputed["activations (recompute)"] == 2 * 2 * 64 * 256 + 770048 == 835584
    # the plain optimizer keeps all of it; a KL penalty adds the reference model's weights
    plain = dict(
        actor_estimate(tiny("actor.megatron.use_distributed_optimizer=false", "algo.kl_coef=0.1"), shape).terms
    )
    assert plain["optimizer"] == 12 * 94592 and plain["reference weights"] == 189184
    # max_tokens_per_micro_batch bounds the tokens; a row is at most the longest sample
    packed = dict(actor_estimate(tiny("actor.max_tokens_per_micro_batch=512"), shape).terms)
    assert packed["logits"] == 2 * terms["logits"]  # 512 tokens instead of 256


def test_moe_experts_split_over_ep_and_tp_and_their_adam_over_expert_data_parallel():
    moe = [
        "model.tiny.architecture=qwen3_moe",
        "cluster.actor_num_gpus=8",
        "actor.megatron.expert_model_parallel_size=2",
    ]
    cfg = tiny(*moe)
    shape = read_shape(cfg)
    # 4 experts of gate, up, down 3 x 64 x 64; the router (64 x 4) is replicated
    assert shape.layer_params() == (4096 * 3, 160 + 256, 4 * 3 * 64 * 64)
    dense = 2 * (4096 * 3 / 2 + 416) + 2 * 512 * 64 / 2 + 64
    experts = 2 * 4 * 3 * 64 * 64 / (2 * 2)  # over EP 2 x TP 2
    terms = dict(actor_estimate(cfg, shape).terms)
    assert terms["weights"] == 2 * (dense + experts)
    assert terms["optimizer"] == 12 * (dense / 4 + experts / 2)  # DP 4; expert DP = DP / EP = 2


def test_pipeline_stages_split_the_weights_and_the_first_keeps_a_micro_batch_per_stage():
    """PP 2 on 8 ranks (TP 2, DP 2): each stage one of the 2 layers; the first stage holds the
    embedding and two micro-batches' activations, the last the output layer, final norm and
    logits. The plan shows the stage with the larger total."""
    cfg = tiny("cluster.actor_num_gpus=8", "actor.megatron.pipeline_model_parallel_size=2")
    shape = read_shape(cfg)
    est = actor_estimate(cfg, shape)
    terms = dict(est.terms)
    # the last stage: one layer 61440 / 2 + 160, the output layer 512 x 64 / 2 and the final norm 64
    last = 61440 / 2 + 160 + 512 * 64 / 2 + 64
    assert terms["weights"] == 2 * last and terms["gradients"] == 4 * last
    assert terms["optimizer"] == 12 * last / 2  # DP = 8 / (TP 2 x PP 2)
    assert terms["activations (no recompute)"] == 770048  # one layer, one micro-batch in flight
    assert terms["logits"] == dict(actor_estimate(tiny(), shape).terms)["logits"]  # the whole vocab shard, all tokens
    assert "the last of 2 pipeline stages (1 of 2 layers)" in est.notes[1] and "PP 2" in est.notes[1]
    # the first stage: the layer and the embedding, two micro-batches in flight (1F1B), no logits
    head_est = stage_estimate(cfg, shape, first=True, last=False)
    head = dict(head_est.terms)
    assert head["weights"] == 2 * (61440 / 2 + 160 + 512 * 64 / 2) and "logits" not in head
    assert head["activations (no recompute)"] == 2 * 770048
    assert head_est.total < est.total


def test_virtual_stages_keep_more_chunks_in_flight():
    """PP 2 x VP 2 of a 4-layer model: chunks of one layer; the first stage keeps 2 (PP - 1) +
    (VP - 1) PP + 1 = 5 chunks' activations in flight (1 + (PP - 1) / (PP VP) = 1.25 times the
    4 layers' of 1F1B), the last (VP - 1) PP + 1 = 3 (1.5 stage-worths against 1F1B's 1)."""
    pp = ("cluster.actor_num_gpus=8", "actor.megatron.pipeline_model_parallel_size=2", "model.tiny.num_hidden_layers=4")
    cfg = tiny(*pp)
    chunked = tiny(*pp, "actor.megatron.virtual_pipeline_model_parallel_size=2")
    shape = read_shape(cfg)
    key = "activations (no recompute)"
    for first, chunks in ((True, 5), (False, 3)):
        plain = dict(stage_estimate(cfg, shape, first=first, last=not first).terms)
        est = stage_estimate(chunked, shape, first=first, last=not first)
        terms = dict(est.terms)
        assert terms[key] == chunks * 770048  # one layer's activations per chunk
        assert terms[key] == plain[key] * (1.25 if first else 1.5)
        assert terms["weights"] == plain["weights"] and "PP 2 VP 2 " in est.notes[1]


def test_an_engine_takes_its_fraction_of_the_gpu():
    cfg = tiny()
    cfg.cluster.gpu_memory_gb = 1  # after loading: the actor's 2 GiB of runtime alone would be refused
    shape = read_shape(cfg)
    weights = 2 * shape.params() / 2
    fraction = cfg.rollout.sglang.mem_fraction_static  # the share SGLang is given
    assert engine_estimate(cfg, shape).terms == (("weights", weights), ("KV cache", fraction * GIB - weights))


def test_nothing_is_refused_while_the_gpu_memory_is_unknown():
    cfg = tiny("actor.max_tokens_per_micro_batch=10000000")
    check_fits(cfg)
    assert "cluster.gpu_memory_gb unset: nothing checked" in summarize(cfg)


def test_a_layout_that_cannot_fit_is_refused_naming_the_biggest_term_and_its_knobs():
    # 2 GiB of runtime alone is more than 1.5 GiB; with recompute, the logits of 40M tokens are the biggest term
    with pytest.raises(ConfigError, match=r"needs ~.* GiB, more than the 1.5 GiB .* biggest term is runtime") as e:
        tiny("cluster.gpu_memory_gb=1.5")
    with pytest.raises(ConfigError, match=r"biggest term is logits \(.* GiB\)") as e:
        tiny("cluster.gpu_memory_gb=40", "actor.max_tokens_per_micro_batch=40000000", "actor.megatron.recompute=true")
    assert "lower actor.max_tokens_per_micro_batch" in e.value.fix and "tensor_model_parallel_size" in e.value.fix
    # rows of 8032 tokens: the unfused attention's scores (5 GiB a layer) make the activations
    # the biggest term; with recompute only one layer's are kept, and it fits
    long = [
        "actor.max_tokens_per_micro_batch=65536",
        "rollout.max_new_tokens=8000",
        "model.tiny.max_position_embeddings=8192",
    ]
    with pytest.raises(ConfigError, match=r"biggest term is activations \(no recompute\)") as e:
        tiny("cluster.gpu_memory_gb=9", *long)
    assert e.value.fix.startswith("set actor.megatron.recompute: true")
    tiny("cluster.gpu_memory_gb=9", *long, "actor.megatron.recompute=true")
    # colocated without offload, the engine's fraction is taken first
    with pytest.raises(ConfigError, match=r"beside the colocated engine's mem_fraction_static") as e:
        tiny("cluster.gpu_memory_gb=6", "cluster.colocate=true", "cluster.rollout_num_gpus=4")
    assert "cluster.offload: true" in e.value.fix


def test_megatron_lms_weight_and_optimizer_formula_on_qwen3_8b():
    """megatron-core (installed) reports no memory estimate; Megatron-LM's
    megatron/training/theoretical_memory_usage.py (not installed) does: its weight + optimizer
    memory is the largest shard's parameters x (18 bytes, or 6 + 12 / DP with the distributed
    optimizer). Its parameter count, written out by hand for Qwen3-8B (h 4096, 36 layers, 32
    heads of 128, 8 query groups, ffn 12288, vocab 151936, a multiple of 128: not padded at TP 1):
    2 L h^2 (attention (1 + 8/32) x 128 x 32 / 4096 + gated MLP 3/2 x 12288 / 4096 + 2 / h
    + 1 / (L h)) + 2 x 151936 x h. It counts each norm as a LayerNorm (weight and bias: 2h, the
    final one too) and leaves out the QK norms (2 x 128 per layer); ours counts RMSNorms."""
    L, h = 36, 4096
    megatron_lm = 2 * L * h * h * ((1 + 8 / 32) * 1 + 1.5 * 12288 / h + 2 / h + 1 / (L * h)) + 2 * 151936 * h
    assert megatron_lm == 8_191_025_152
    shape = ModelShape(4096, 36, 32, 8, 128, 12288, 151936, qk_norm=True)
    split, replicated, _ = shape.layer_params()
    ours = L * (split + replicated) + 2 * 151936 * h + h
    assert ours - megatron_lm == L * 2 * 128 - L * 2 * h - h == -289792
    for dp, distributed, per_param in ((1, False, 18), (8, True, 6 + 12 / 8)):
        cfg = load_config(
            "jobs/configs/embedded.yaml",
            ["model.tiny.architecture=qwen3", "actor.backend=megatron", "actor.megatron.bf16=true",
             f"actor.megatron.use_distributed_optimizer={distributed}", "cluster.gpus_per_node=16",
             f"cluster.actor_num_gpus={dp}", "cluster.rollout_num_gpus=1"],
        )  # fmt: skip
        t = dict(actor_estimate(cfg, shape).terms)
        assert t["weights"] + t["gradients"] + t["optimizer"] == pytest.approx(per_param * ours)
        assert t["weights"] + t["gradients"] + t["optimizer"] == pytest.approx(per_param * megatron_lm, rel=4e-5)


def test_jobs_submit_refuses_a_layout_that_cannot_fit_before_writing_anything(tmp_path):
    """The refusal as a user meets it: jobs/submit.py exits 2 with the plan's message and its fix,
    and no run dir is made."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    args = [sys.executable, str(repo / "jobs" / "submit.py"), "--cluster", "local", "--run-dir", str(run)]
    for override in (*TINY, "cluster.gpu_memory_gb=1.5"):
        args += ["--set", override]
    p = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=repo)
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2, out[-3000:]
    assert "an actor rank needs ~" in out and "more than the 1.5 GiB" in out and "fix:" in out, out[-3000:]
    assert "Traceback" not in out and not run.exists()


def test_a_tied_model_counts_its_embedding_once():
    """Tied embeddings (issue 40): one vocab matrix, as the checkpoint holds it; the published
    parameter counts of Llama-3.2-1B and Qwen2.5-1.5B come out exactly; the megatron rank's
    single stage holds no output layer of its own."""
    import json
    from pathlib import Path

    models = Path(__file__).resolve().parents[1] / "support" / "models"
    shapes = {m: ModelShape.from_hf(json.loads((models / m / "config.json").read_text())) for m in
              ("llama-3.2-1b-instruct", "qwen2.5-1.5b-instruct")}  # fmt: skip
    assert {m: s.params() for m, s in shapes.items()} == {
        "llama-3.2-1b-instruct": 1_235_814_400,
        "qwen2.5-1.5b-instruct": 1_543_714_304,
    }
    llama = shapes["llama-3.2-1b-instruct"]
    cfg = load_config(None, [f"model.path={models / 'llama-3.2-1b-instruct'}", "actor.backend=megatron",
                             "actor.megatron.bf16=false"])  # fmt: skip
    (weights,) = [b for name, b in stage_estimate(cfg, llama, True, True).terms if name == "weights"]
    assert weights == 4 * llama.params()  # fp32; its vocab (128256) needs no padding


def test_the_megatron_plan_counts_bf16_by_default_as_the_gpu_ranks_run():
    """actor.megatron.bf16 null (the default): bf16 on a GPU that has it, which the plan (made
    for GPUs) counts; false: fp32, twice the weight bytes and Adam without a master copy. The
    ranks decide the same way, from the hardware they find (MegatronConfig.uses_bf16)."""
    default, fp32 = tiny("actor.megatron.bf16=null"), tiny("actor.megatron.bf16=false")
    assert default.actor.megatron.bf16 is None
    assert default.actor.megatron.uses_bf16(device_has_bf16=True)
    assert not default.actor.megatron.uses_bf16(device_has_bf16=False)  # CPU / gloo: fp32
    assert fp32.actor.megatron.uses_bf16(device_has_bf16=True) is False
    terms = {cfg: dict(actor_estimate(c, read_shape(c)).terms) for cfg, c in (("default", default), ("fp32", fp32))}
    assert terms["fp32"]["weights"] == 2 * terms["default"]["weights"]
    assert terms["default"]["optimizer"] / terms["fp32"]["optimizer"] == 12 / 8
    assert "bf16" in summarize(default) and "fp32" in summarize(fp32)
