"""FP8 rollout (``rollout.quantization: fp8``): blockwise FP8 weights as SGLang 0.5.23 loads them.

SGLang serves block-quantized FP8 only from an FP8-serialized checkpoint: its ``Fp8Config``
refuses ``weight_block_size`` otherwise, and ``--quantization fp8`` on a bf16 checkpoint
quantizes per channel once at load, replacing the parameters a push would write. So the engines
start from a copy of the model quantized here (``write_checkpoint``: config.json's
``quantization_config`` as DeepSeek's and Qwen's FP8 checkpoints carry it) and every push sends
the trainer's weights quantized by the same recipe (``quantized_named``), scales beside them.

The recipe (DeepSeek-V3's, what SGLang's block-FP8 kernels read): each linear weight ``[out, in]``
is cut into 128 x 128 blocks; a block's scale is its largest magnitude / 448 (the largest
float8_e4m3fn), its values are ``w / scale`` cast to float8_e4m3fn (round to nearest), and the
float32 scales ``[ceil(out/128), ceil(in/128)]`` travel as ``<module>.weight_scale_inv`` (despite
the name, the factor that dequantizes: ``w ~ q * scale``). Quantized: every 2-D
``model.layers.*.<...>_proj.weight`` (attention and MLP projections, MoE experts), the linear
layers SGLang's ``Fp8Config`` gives its FP8 method; not the embeddings, norms, lm_head or a MoE
router (``mlp.gate``, kept in bf16 by SGLang's online FP8 path too).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from rlhpc.errors import RlhpcError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = (128, 128)  # weight_block_size: [block_n (out), block_k (in)]
SCALE = "weight_scale_inv"
# What SGLang's Fp8Config.from_config reads from config.json (quant_method "fp8": serialized;
# block-wise needs the dynamic activation scheme).
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
}
_QUANTIZED = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
# Column-parallel (split by output rows, merged into qkv_proj / gate_up_proj / w13) and
# row-parallel (split by input columns) projections, as SGLang's block checks see them.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def quantizes(name: str, shape: Iterable[int]) -> bool:
    """Does the FP8 engine hold ``name`` (a checkpoint name) in FP8 with a block scale?"""
    return len(tuple(shape)) == 2 and bool(_QUANTIZED.match(name))


def scale_name(name: str) -> str:
    """``...q_proj.weight`` -> ``...q_proj.weight_scale_inv``."""
    return name.removesuffix("weight") + SCALE


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [out, in] -> (float8_e4m3fn [out, in], float32 scales [ceil(out/128), ceil(in/128)]),
    computed in float32 on ``w``'s device. A block of zeros gets the smallest positive scale (its
    values stay 0). NaN or an infinity in a block makes its scale NaN or infinite: the push's
    check of what leaves the trainer sees it in the scales."""
    out, inp = w.shape
    bn, bk = BLOCK
    pad_out, pad_in = -out % bn, -inp % bk
    x = w.detach().float()
    if pad_out or pad_in:
        x = torch.nn.functional.pad(x, (0, pad_in, 0, pad_out))
    blocks = x.view(x.shape[0] // bn, bn, x.shape[1] // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = amax.clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.view(x.shape)[:out, :inp].contiguous()
    return q, scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight an FP8 engine computes with: each block's values times its scale."""
    bn, bk = BLOCK
    s = scale.repeat_interleave(bn, dim=0)[: q.shape[0]].repeat_interleave(bk, dim=1)[:, : q.shape[1]]
    return (q.float() * s).to(dtype)


def quantized_named(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A push's tensors (checkpoint names) as the FP8 engine holds them: each quantized weight
    as its FP8 values then its scales, everything else unchanged; lazily, one tensor at a time,
    so a bucket holds the quantized bytes (half of bf16's), never the model."""
    for name, t in named:
        if quantizes(name, t.shape):
            q, s = quantize(t)
            yield name, q
            yield scale_name(name), s
        else:
            yield name, t


def push_bytes(shapes: dict[str, tuple[int, ...]], dtype_bytes: int) -> int:
    """Bytes one push sends for weights of these checkpoint names and shapes: the quantized ones
    at one byte a value plus float32 scales, the rest at ``dtype_bytes``."""
    total = 0
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        if quantizes(name, shape):
            total += n + 4 * _ceil(shape[0], BLOCK[0]) * _ceil(shape[1], BLOCK[1])
        else:
            total += n * dtype_bytes
    return total


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------ what SGLang refuses


def block_problems(shapes: dict[str, tuple[int, ...]], tp: int) -> list[str]:
    """What SGLang's block-FP8 layers refuse at start, for weights of these checkpoint names and
    shapes at engine TP ``tp``: a column-parallel projection (merged into qkv_proj, gate_up_proj
    or an expert's w13) whose output rows per rank are not a multiple of 128, and at TP > 1 a
    row-parallel one (o_proj, down_proj) whose input columns per rank are not
    (``Fp8LinearMethod.validate_block_quant_shapes``, ``Fp8MoEMethod.create_weights``)."""
    bn, bk = BLOCK
    problems = []
    for name, shape in shapes.items():
        if not quantizes(name, shape):
            continue
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]
        out, inp = shape
        if module in _COLUMN and (out % tp or (out // tp) % bn):
            problems.append(f"{name} [{out}, {inp}]: {out} output rows / TP {tp} is not a multiple of {bn}")
        elif module in _ROW and tp > 1 and (inp % tp or (inp // tp) % bk):
            problems.append(f"{name} [{out}, {inp}]: {inp} input columns / TP {tp} is not a multiple of {bk}")
    return problems


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a checkpoint's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is no mapping)
                shapes[name] = tuple(st.get_slice(name).get_shape())
    return shapes


def tiny_shapes(tiny: Any) -> dict[str, tuple[int, ...]]:
    """The projections' shapes of a ``model.tiny`` (``rlhpc.config.TinyModelConfig``), one
    layer's: what ``rlhpc.model.build_tiny_model`` builds (head_dim = hidden / heads)."""
    h, heads = tiny.hidden_size, tiny.num_attention_heads
    moe = tiny.moe_intermediate_size if tiny.architecture == "qwen3_moe" else None
    return layer_shapes(h, heads, tiny.num_key_value_heads, h // heads, tiny.intermediate_size, moe)


def config_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """One layer's projections from the config.json at ``path``: what a dry run checks when the
    model directory holds only its config (the weights not downloaded yet); the checkpoint's own
    shapes (``checkpoint_shapes``) once they are there."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    moe = cfg.get("moe_intermediate_size") if cfg.get("num_experts") or cfg.get("n_routed_experts") else None
    return layer_shapes(
        h, heads, int(cfg.get("num_key_value_heads") or heads), int(cfg.get("head_dim") or h // heads),
        int(cfg["intermediate_size"]), moe,
    )  # fmt: skip


def layer_shapes(
    h: int, heads: int, kv: int, d: int, intermediate: int, moe_intermediate: int | None
) -> dict[str, tuple[int, ...]]:
    """One layer's attention and MLP projections (an expert's, with ``moe_intermediate``), HF-named."""
    p = "model.layers.0."
    shapes = {
        f"{p}self_attn.q_proj.weight": (heads * d, h),
        f"{p}self_attn.k_proj.weight": (kv * d, h),
        f"{p}self_attn.v_proj.weight": (kv * d, h),
        f"{p}self_attn.o_proj.weight": (h, heads * d),
    }
    if moe_intermediate is not None:
        i = moe_intermediate
        mlp = {"mlp.experts.0.gate_proj": (i, h), "mlp.experts.0.up_proj": (i, h), "mlp.experts.0.down_proj": (h, i)}
    else:
        i = intermediate
        mlp = {"mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    shapes.update({f"{p}{m}.weight": s for m, s in mlp.items()})
    return shapes


# ------------------------------------------------------------------ the engines' checkpoint


def quantization_config(path: str | Path) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` (None when the checkpoint is not quantized, or not
    there yet: the engines' copy before the first start writes it)."""
    config = Path(path) / "config.json"
    return json.loads(config.read_text()).get("quantization_config") if config.is_file() else None


def is_fp8_checkpoint(path: str | Path) -> bool:
    """Is ``path`` block-FP8 as ``write_checkpoint`` writes it (and SGLang loads it)?"""
    q = quantization_config(path)
    return bool(q) and q.get("quant_method") == "fp8" and q.get("weight_block_size") == list(BLOCK)


def write_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """``src`` (an HF checkpoint in safetensors) as the FP8 engines load it, in ``dst``: each
    safetensors file with its quantized weights replaced by FP8 values and scales, config.json
    with ``quantization_config``, every other file (tokenizer, generation config) copied. Written
    beside ``dst`` and renamed into place, so a half-written copy is never served."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise RlhpcError(f"{src} has no safetensors files to quantize", "convert the model to safetensors")
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            tensors = dict(quantized_named((n, st.get_tensor(n)) for n in st.keys()))  # noqa: SIM118
        save_file(tensors, str(tmp / f.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, f.name))
    for other in src.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name not in ("config.json",):
            if other.name == "model.safetensors.index.json":
                index = json.loads(other.read_text())
                index["weight_map"] = weight_map
                (tmp / other.name).write_text(json.dumps(index, indent=2))
            else:
                shutil.copy2(other, tmp / other.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst
