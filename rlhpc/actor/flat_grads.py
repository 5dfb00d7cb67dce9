"""Gradients in one fixed layout, reduced over the data-parallel ranks in that layout.

PyTorch's DDP reduces gradients in buckets and rebuilds their layout after the first iteration
of each process, in the order the gradients became ready. With more than two ranks the rounding
of a sum depends on how the collective splits and orders it (two addends commute; four do not
associate), so the first step after a resume (DDP's first buckets) and the same step of the
uninterrupted run (its rebuilt buckets) differ in the last bits, and the runs drift apart from
there (measured on 4 gloo ranks: the loss differs at the first step trained after the load).

Here the layout is a pure function of the model: each parameter's gradient is a view into one
flat buffer per dtype, in ``parameters()`` order (the order ``flatten_parameters`` lays the
weights in), as megatron-core's DDP keeps its contiguous grad buffer. Autograd accumulates into
the views in place, and one all-reduce per buffer runs after the step's last backward, so every
start of the process reduces the same bytes in the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class FlatGrads:
    """The gradients of ``module``'s trainable parameters as views of one buffer per dtype."""

    def __init__(self, module: torch.nn.Module):
        params = [p for p in module.parameters() if p.requires_grad]  # tied weights once
        self.buffers: list[torch.Tensor] = []
        self._views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for dtype in dict.fromkeys(p.dtype for p in params):
            group = [p for p in params if p.dtype == dtype]
            flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
            offset = 0
            for p in group:
                self._views.append((p, flat[offset : offset + p.numel()].view_as(p)))
                offset += p.numel()
            self.buffers.append(flat)
        self.zero()

    def zero(self) -> None:
        """Zero the buffers and (re)attach the views as ``.grad``: whoever set a gradient to None
        in between (``optimizer.zero_grad()``) cannot leave a parameter outside the reduction."""
        for flat in self.buffers:
            flat.zero_()
        for p, view in self._views:
            p.grad = view

    def all_reduce_mean(self, group: dist.ProcessGroup | None = None) -> None:
        """Average the gradients over ``group`` (every rank of it must call this)."""
        size = dist.get_world_size(group)
        if size == 1:
            return
        for p, view in self._views:  # a fresh tensor in .grad would be left out of the sum
            if p.grad is not view:
                raise RuntimeError("a gradient was replaced after FlatGrads.zero(): call zero() before the backward")
        for flat in self.buffers:
            dist.all_reduce(flat, group=group)
            flat.div_(size)
