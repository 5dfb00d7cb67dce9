"""FP8 rollout's recipe, its refusals and its counts (``rlhpc.weights.fp8``), pinned to SGLang's wheel."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from support import sglang_wheel

from rlhpc.cluster import timing
from rlhpc.cluster.memory import ModelShape, engine_estimate
from rlhpc.config import ConfigError, TinyModelConfig, config_from_dict
from rlhpc.engine_server.sglang import SGLangSpec, launch_server_command
from rlhpc.weights import fp8
from rlhpc.weights.tensor_transport import flat_layout, flatten_into, non_finite
from rlhpc.wire.protocol import FP8_QUANTIZATION, QUANTIZATION_FLAG

FP8_PY = "sglang/srt/layers/quantization/fp8.py"


def test_quantize_then_dequantize_is_within_fp8_s_bound() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 1, 200)  # ragged blocks, columns of every size
    w[:128, :128] = 0  # a block of zeros
    q, s = fp8.quantize(w.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (math.ceil(300 / 128), math.ceil(200 / 128))
    back = fp8.dequantize(q, s)
    ref = w.to(torch.bfloat16).float()
    scale = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    # e4m3: 3 mantissa bits, half an ulp is 2^-4 of a normal value; below 2^-6 the subnormal
    # step is 2^-9 (of the block's scale), half of it 2^-10
    bound = torch.maximum(ref.abs() * 2**-4, scale * 2**-10)
    assert ((back - ref).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(back[:128, :128], torch.zeros(128, 128))
    # every block's largest value maps onto FP8's largest exactly
    assert q.float().abs().amax() == fp8.FP8_MAX
    # the same recipe gives the same bytes (what an engine is compared with)
    q2, s2 = fp8.quantize(w.to(torch.bfloat16))
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_diverged_weight_shows_in_its_scales_and_the_push_check_sees_it(bad: float) -> None:
    w = torch.randn(128, 256)
    w[3, 200] = bad
    named = list(fp8.quantized_named([("model.layers.0.mlp.up_proj.weight", w)]))
    assert [n for n, _ in named] == ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv"]
    tensors = [t for _, t in named]
    flat = flatten_into(tensors, torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8))
    dtypes = [t.dtype for t in tensors]
    spans = flat_layout(dtypes, [list(t.shape) for t in tensors])
    assert non_finite(flat, dtypes, spans, [n for n, _ in named]) == ["model.layers.0.mlp.up_proj.weight_scale_inv"]


def test_what_is_quantized_is_what_sglang_s_fp8_config_quantizes() -> None:
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "model.layers.1.mlp.experts.7.gate_proj.weight",
    ):
        assert fp8.quantizes(name, (256, 128)), name
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.gate.weight",  # the MoE router: SGLang keeps it unquantized with fp8
        "model.layers.0.self_attn.q_proj.bias",
    ):
        assert not fp8.quantizes(name, (256, 128)), name
    assert not fp8.quantizes("model.layers.0.self_attn.q_norm.weight", (128,))
    # SGLang's Qwen3-MoE gate gets a quant config only from modelslim
    src = sglang_wheel.source("sglang/srt/models/qwen3_moe.py")
    assert 'quant_config.get_name() == "modelslim"' in src and "quant_config=gate_quant_config" in src


def test_protocol_fields_are_sglang_s() -> None:
    """The names, the config.json keys and the refusals rlhpc mirrors, read from the wheel."""
    src = sglang_wheel.source(FP8_PY)
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "Fp8Config")
    from_config = ast.unparse(next(f for f in cls.body if getattr(f, "name", "") == "from_config"))
    for key in ("quant_method", "activation_scheme", "weight_block_size"):
        assert f"'{key}'" in from_config, key
    assert "is_checkpoint_fp8_serialized = 'fp8' in quant_method" in from_config  # "fp8": serialized FP8
    # blocks need an FP8-serialized checkpoint and the dynamic scheme: why the engines start from a quantized copy
    assert "The block-wise quantization only supports fp8-serialized checkpoint" in src
    assert "only supports dynamic activation scheme" in src
    assert fp8.QUANTIZATION_CONFIG["activation_scheme"] == "dynamic"
    # the scale parameter's name and shape: ceil-divided blocks of float32
    assert f'register_parameter("{fp8.SCALE}", scale)' in src
    assert "(output_size_per_partition + block_n - 1) // block_n" in src
    assert "torch.float8_e4m3fn if is_checkpoint_fp8_serialized else params_dtype" in src
    # what block_problems mirrors: merged/column-parallel output rows, row-parallel input columns at TP > 1
    assert "if output_partition_size % block_n != 0:" in src
    assert "if input_size_per_partition % block_k != 0:" in src
    # an update does not re-quantize: block FP8 weights are loaded as sent (no restore hook in Fp8LinearMethod)
    lin = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "Fp8LinearMethod")
    assert "restore_weights_before_loading" not in {getattr(f, "name", "") for f in lin.body}
    # the launch flag and its choice
    assert QUANTIZATION_FLAG in sglang_wheel.server_flags()
    choices = sglang_wheel.source("sglang/srt/arg_groups/choices.py")
    assert f'"{FP8_QUANTIZATION}"' in choices.split("QUANTIZATION_CHOICES = [", 1)[1].split("]", 1)[0]


def test_sglang_is_launched_with_fp8_on_the_quantized_copy(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "fp8"}}')
    spec = SGLangSpec(tp_size=1, mem_fraction_static=0.8, memory_saver=False, seed=0)
    cmd = launch_server_command("python", str(tmp_path), "h", 1, 2, spec)
    assert cmd[cmd.index(QUANTIZATION_FLAG) + 1] == "fp8"
    assert not fp8.is_fp8_checkpoint(tmp_path / "not yet written")
    (tmp_path / "config.json").write_text("{}")
    assert QUANTIZATION_FLAG not in launch_server_command("python", str(tmp_path), "h", 1, 2, spec)


def tree(**rollout) -> dict:
    return {"model": {"tiny": {"hidden_size": 256, "num_key_value_heads": 2}}, "rollout": rollout}


def test_tis_is_on_by_default_with_fp8_and_can_be_turned_off() -> None:
    assert config_from_dict(tree(quantization="fp8")).algo.tis is True
    assert config_from_dict(tree()).algo.tis is False
    assert config_from_dict({**tree(quantization="fp8"), "algo": {"tis": False}}).algo.tis is False


def test_preflight_refuses_what_cannot_work(tmp_path) -> None:
    from rlhpc.preflight import config_from_dict as checked

    checked(tree(quantization="fp8"))  # 256 wide: every block fits
    with pytest.raises(ConfigError, match=r"128x128 FP8 blocks do not fit model.tiny.*k_proj.*32 output rows") as e:
        checked({"model": {"tiny": {}}, "rollout": {"quantization": "fp8"}})  # 64 wide, k/v 32 rows
    assert "drop rollout.quantization" in e.value.fix
    with pytest.raises(ConfigError, match="actor.lora.push: adapter") as e:
        config_from_dict({**tree(quantization="fp8"), "actor": {"lora": {"rank": 4, "push": "adapter"}}})
    assert "push: merged" in e.value.fix
    moe = {"tiny": {"architecture": "qwen3_moe", "hidden_size": 256, "moe_intermediate_size": 128}}
    with pytest.raises(ConfigError, match="MoE model, on the CPU engine"):
        checked({"model": moe, "rollout": {"quantization": "fp8"}})


def test_the_memory_plan_and_the_time_planner_count_fp8_engines() -> None:
    shape = ModelShape.from_tiny(TinyModelConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32))
    bf16, q = shape.engine_weight_bytes(None), shape.engine_weight_bytes("fp8")
    proj = shape.projection_params()
    assert bf16 == 2 * shape.params() and q == pytest.approx(bf16 - proj + proj * 4 / 128**2)
    assert 0.5 < q / bf16 < 0.6  # the embeddings stay bf16
    cfg = config_from_dict({"model": {"path": None, "tiny": {}}, "cluster": {"gpu_memory_gb": 80}})
    cfg8 = config_from_dict(
        {"model": {"tiny": {}}, "cluster": {"gpu_memory_gb": 80}, "rollout": {"quantization": "fp8"}}
    )
    assert engine_estimate(cfg8, shape).terms[0][1] == pytest.approx(q)
    assert engine_estimate(cfg, shape).terms[0][1] == pytest.approx(bf16)
    gpu = timing.GPUS["H100"]
    a, b = timing.estimate(cfg, gpu, shape), timing.estimate(cfg8, gpu, shape)
    assert b.push < a.push and "FP8" in b.notes[2]
    # the checkpoint's bytes, counted by name as a push sends them
    shapes = {"model.layers.0.self_attn.q_proj.weight": (256, 256), "model.embed_tokens.weight": (100, 256)}
    assert fp8.push_bytes(shapes, 2) == 256 * 256 + 4 * 4 + 2 * 100 * 256


def test_a_dry_run_against_a_config_json_alone_reads_the_shapes_from_it() -> None:
    """Qwen3-30B-A3B's published config.json (no weights): its projections' shapes, and the
    128-row blocks fit at TP 2 (each rank 384 of an expert's 768 rows) but not at TP 8 (96)."""
    path = Path(__file__).resolve().parents[1] / "support" / "models" / "qwen3-30b-a3b"
    shapes = fp8.config_shapes(path)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32 * 128, 2048)  # head_dim 128, not 2048 / 32
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (4 * 128, 2048)
    assert shapes["model.layers.0.mlp.experts.0.down_proj.weight"] == (2048, 768)
    assert not fp8.block_problems(shapes, 2)
    assert any("experts" in p for p in fp8.block_problems(shapes, 8))
