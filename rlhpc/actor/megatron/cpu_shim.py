"""Test support: run megatron-core's forward pass on a CPU-only torch over gloo.

Nothing here runs at import time; call :func:`apply_cpu_shim` explicitly, and only in a
process that has no GPU (tests, CPU smoke runs). On a GPU node megatron-core needs none of
this, and the production code paths never call it.

Redirects (each process-wide, idempotent, undone by :func:`remove_cpu_shim`):

* ``torch.cuda.current_device`` -> ``"cpu"``. megatron-core allocates with
  ``device=torch.cuda.current_device()`` in the global memory buffer (attention / sequence
  parallel gathers), ``DotProductAttention``'s buffers, rotary embeddings built without
  ``use_cpu_initialization``, the tensor-parallel linear layers and GPTModel. On a CPU-only
  torch that call raises; returning ``"cpu"`` makes every such ``torch.empty`` a CPU tensor.
* The CUDA RNG tracker (``tensor_parallel.random.CudaRNGStatesTracker``) -> a tracker over the
  CPU generator. Megatron forks named RNG streams (data-parallel, tensor-parallel, expert) for
  weight init and dropout with ``torch.cuda.get_rng_state``/``_set_cuda_rng_state``, which
  need CUDA; the replacement keeps the same named streams but stores CPU generator states.
* ``megatron.core.fusions.fused_softmax.get_default_causal_mask`` -> the same mask on the CPU.
  The unfused softmax builds the causal mask with a hard-coded ``device="cuda"`` when the
  caller passes ``attention_mask=None``.

Not covered yet (needed only for training with megatron's optimizer, see facts.md):
``device='cuda'`` in ``get_megatron_optimizer``/grad clipping/grad scaler, and the
``Tensor.type() == 'torch.cuda.FloatTensor'`` asserts in grad clipping and the distributed
optimizer.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

_ORIGINALS: dict[str, Any] = {}


def _cpu_current_device() -> str:
    return "cpu"


@functools.lru_cache
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    base = _ORIGINALS.get("CudaRNGStatesTracker", mrandom.CudaRNGStatesTracker)

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """``CudaRNGStatesTracker`` with the same named streams, kept on the CPU generator."""

        def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def apply_cpu_shim() -> None:
    """Install the redirects listed in the module docstring (no-op if already applied)."""
    if _ORIGINALS:
        return
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_shim() is for CPU-only processes; this one sees a GPU")
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    _ORIGINALS["get_default_causal_mask"] = fused_softmax.get_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    _ORIGINALS["current_device"] = torch.cuda.current_device
    _ORIGINALS["CudaRNGStatesTracker"] = mrandom.CudaRNGStatesTracker
    torch.cuda.current_device = _cpu_current_device
    mrandom.CudaRNGStatesTracker = _cpu_tracker_class()
    # A tracker created before the shim would still be the CUDA one.
    mrandom.initialize_rng_tracker(force_reset=True)


def remove_cpu_shim() -> None:
    """Undo :func:`apply_cpu_shim`."""
    if not _ORIGINALS:
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    fused_softmax.get_default_causal_mask = _ORIGINALS.pop("get_default_causal_mask")
    torch.cuda.current_device = _ORIGINALS.pop("current_device")
    mrandom.CudaRNGStatesTracker = _ORIGINALS.pop("CudaRNGStatesTracker")
    mrandom.initialize_rng_tracker(force_reset=True)
