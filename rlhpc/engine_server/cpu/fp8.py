"""The CPU engine on a block-FP8 checkpoint (``rlhpc.weights.fp8``), as SGLang holds one.

Each quantized projection keeps its float8_e4m3fn weight and float32 ``weight_scale_inv`` as
parameters under SGLang's names, so a push writes them byte for byte (a full-precision tensor
sent to an FP8 weight is cast without new scales, as SGLang's weight loader's ``copy_`` does);
the forward dequantizes block by block and multiplies in float32. transformers would dequantize
such a checkpoint to bf16 on a machine without a GPU, so the model is built from its config and
its tensors are read here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlhpc.errors import RlhpcError
from rlhpc.weights.fp8 import FP8, SCALE, checkpoint_shapes, dequantize, quantizes


class Fp8Linear(torch.nn.Module):
    """``nn.Linear`` with block-FP8 weights: ``weight`` float8_e4m3fn [out, in] and
    ``weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)]."""

    def __init__(self, linear: torch.nn.Linear, scale_shape: tuple[int, ...]):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.nn.Parameter(torch.zeros(linear.weight.shape, dtype=FP8), requires_grad=False)
        setattr(self, SCALE, torch.nn.Parameter(torch.ones(scale_shape), requires_grad=False))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize(self.weight, getattr(self, SCALE), x.dtype)
        return torch.nn.functional.linear(x, w, self.bias)


def load_fp8_model(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The causal LM at ``path`` (written by ``rlhpc.weights.fp8.write_checkpoint``), its
    quantized projections ``Fp8Linear``, every other weight in float32."""
    from safetensors import safe_open

    config = AutoConfig.from_pretrained(str(path))
    del config.quantization_config  # built here, not by transformers' FP8 quantizer
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shapes = checkpoint_shapes(path)
    for name, shape in shapes.items():
        if not quantizes(name, shape):
            continue
        module_name = name.removesuffix(".weight")
        parent, _, child = module_name.rpartition(".")
        try:
            linear = model.get_submodule(module_name)
        except AttributeError:
            linear = None
        if not isinstance(linear, torch.nn.Linear):
            raise RlhpcError(
                f"{path}: the CPU engine holds no FP8 weight for {name} (fused MoE experts are not built in FP8 here)",
                "use rollout.backend: sglang for FP8 MoE models, or drop rollout.quantization",
            )
        model.get_submodule(parent).register_module(
            child, Fp8Linear(linear, shapes[name.removesuffix("weight") + SCALE])
        )
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    with torch.no_grad():
        for f in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is no mapping)
                    p = params.get(name)
                    if p is None:
                        raise RlhpcError(f"{path}: {name} is no parameter of the model", "rewrite the FP8 copy")
                    p.copy_(st.get_tensor(name))
                    loaded.add(name)
    tied = {n for n, p in params.items() if n not in loaded and any(p is params[m] for m in loaded)}
    missing = sorted(set(params) - loaded - tied)
    if missing:
        raise RlhpcError(f"{path} lacks {len(missing)} weight(s): {missing[:3]}", "rewrite the FP8 copy of the model")
    return model.to(device)
