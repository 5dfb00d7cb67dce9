"""A transformers MoE model's routing, recorded and replayed (rollout routing replay, "R3").

The CPU engine records which experts its forward chose (SGLang's ``--enable-return-routed-experts``)
and the PyTorch actor replays the engine's choice in its own forwards. Both act on the router
modules' answers, ``(logits, top-k weights, top-k ids)`` of transformers' ``Qwen3MoeTopKRouter``
(``Qwen3MoeSparseMoeBlock`` sends its experts whatever its router answers): recording reads the
ids, replay replaces them by given ones and recomputes their weights from the router's own
logits as the router would have (softmax, the top-k's probabilities, renormalised with
``norm_topk_prob``), so the gradient still reaches the router through the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rlhpc.errors import RlhpcError

UNKNOWN = -1  # a position whose routing was not given (pads, the last token): the router's own top-k


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order (empty for a dense model)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]


@contextlib.contextmanager
def recorded(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """While open, every forward leaves its routing in the yielded list: ``[tokens, layers, top-k]``
    (the tokens flattened batch-major, as the router sees them), the newest forward last."""
    mods = routers(model)
    out: list[torch.Tensor] = []
    current: dict[int, torch.Tensor] = {}

    def hook(module: torch.nn.Module, _inputs: Any, answer: tuple) -> None:
        current[layer[id(module)]] = answer[2].detach()
        if len(current) == len(mods):
            out.append(torch.stack([current[k] for k in range(len(mods))], dim=1).to(torch.int32))
            current.clear()

    layer = {id(m): k for k, m in enumerate(mods)}
    handles = [m.register_forward_hook(hook) for m in mods]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def replayed(model: torch.nn.Module, experts: torch.Tensor | None) -> Iterator[None]:
    """Every forward while open routes token t of layer l to ``experts[t, l]`` ([tokens, layers,
    top-k], the tokens flattened batch-major as the router sees them; rows of ``UNKNOWN`` keep
    the router's own choice). ``None``: nothing replayed."""
    if experts is None:
        yield
        return
    mods = routers(model)
    if experts.shape[1] != len(mods):
        raise RlhpcError(
            f"the engines returned routing for {experts.shape[1]} MoE layers; the actor's model has {len(mods)}",
            "serve the actor's model on the engines (rollout routing replay needs the same MoE model on both)",
        )

    def hook_for(k: int) -> Any:
        def hook(module: torch.nn.Module, _inputs: Any, answer: tuple) -> tuple:
            logits, _, own = answer
            given = experts[:, k].to(device=own.device, dtype=own.dtype)
            if given.shape != own.shape:
                raise RlhpcError(
                    f"routing of shape {tuple(given.shape)} given for a forward routing {tuple(own.shape)}",
                    "serve the actor's model on the engines (the same top-k and the same tokens)",
                )
            ids = torch.where((given == UNKNOWN).any(-1, keepdim=True), own, given)
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, ids)
            if module.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), ids

        return hook

    handles = [m.register_forward_hook(hook_for(k)) for k, m in enumerate(mods)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
