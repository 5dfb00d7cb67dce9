"""MoE experts on the wire: one tensor per expert and projection, in the checkpoint's names.

transformers keeps a Qwen3-MoE layer's experts as two 3-D parameters, ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``mlp.experts.down_proj`` ``[E, H, I]``.
Checkpoints on disk, and so SGLang's ``Qwen3MoeForCausalLM.load_weights`` (through
``FusedMoE.make_expert_params_mapping``), name each expert's ``mlp.experts.<e>.gate_proj.weight``
``[I, H]``, ``up_proj.weight`` ``[I, H]`` and ``down_proj.weight`` ``[H, I]``; a fused name matches none
of SGLang's mappings and is skipped without an error. So every weight push sends the per-expert
names (one wire format for every engine) and the CPU engine maps them onto its fused parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"


def per_expert(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``name``'s tensor as the checkpoint names it: views of each expert's projections for a
    fused expert tensor, ``[(name, t)]`` for everything else. Gate, up of expert 0, gate, up of
    expert 1, ... lie back to back in ``gate_up_proj``'s memory, so the views keep its order."""
    if name.endswith(GATE_UP) and t.dim() == 3:
        experts = name[: -len("gate_up_proj")]
        half = t.shape[1] // 2
        out = []
        for e in range(t.shape[0]):
            out += [(f"{experts}{e}.gate_proj.weight", t[e, :half]), (f"{experts}{e}.up_proj.weight", t[e, half:])]
        return out
    if name.endswith(DOWN) and t.dim() == 3:
        experts = name[: -len("down_proj")]
        return [(f"{experts}{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
    return [(name, t)]


# transformers 5 keeps a Qwen-VL model's language model under ``model.language_model.`` and its
# vision tower under ``model.visual.``; its checkpoints, and SGLang's Qwen2-VL/Qwen2.5-VL classes
# (whose ``load_weights`` skips a name it does not have, without an error), name them
# ``model.`` and ``visual.``.
VISION_LANGUAGE_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def checkpoint_name(name: str) -> str:
    for memory, checkpoint in VISION_LANGUAGE_PREFIXES:
        if name.startswith(memory):
            return checkpoint + name[len(memory) :]
    return name


def checkpoint_named(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF in-memory names -> the checkpoint's (what SGLang loads), lazily."""
    for name, t in named:
        yield from per_expert(checkpoint_name(name), t)
