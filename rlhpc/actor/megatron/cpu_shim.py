"""Run megatron-core (forward, DDP, optimizer, torch_dist checkpoints) on a CPU-only torch over gloo.

Nothing here runs at import time; call :func:`apply_cpu_shim` explicitly, and only in a
process that has no GPU (tests, CPU smoke runs): the megatron rank and
``tools/convert_checkpoint.py`` apply it when they find no GPU. On a GPU node megatron-core
needs none of this and nothing applies it.

Redirects (each process-wide, idempotent, undone by :func:`remove_cpu_shim`):

* ``torch.cuda.current_device`` -> ``"cpu"``. megatron-core allocates with
  ``device=torch.cuda.current_device()`` in the global memory buffer (attention / sequence
  parallel gathers), ``DotProductAttention``'s buffers, rotary embeddings built without
  ``use_cpu_initialization``, the tensor-parallel linear layers and GPTModel. On a CPU-only
  torch that call raises; returning ``"cpu"`` makes every such ``torch.empty`` a CPU tensor.
* ``torch.cuda.synchronize`` -> a no-op (CPU work is synchronous). ``dist_checkpointing``'s
  writer calls it before copying tensors out.
* The CUDA RNG tracker (``tensor_parallel.random.CudaRNGStatesTracker``) -> a tracker over the
  CPU generator. Megatron forks named RNG streams (data-parallel, tensor-parallel, expert) for
  weight init and dropout with ``torch.cuda.get_rng_state``/``_set_cuda_rng_state``, which
  need CUDA; the replacement keeps the same named streams but stores CPU generator states.
* ``megatron.core.fusions.fused_softmax.get_default_causal_mask`` -> the same mask on the CPU.
  The unfused softmax builds the causal mask with a hard-coded ``device="cuda"`` when the
  caller passes ``attention_mask=None``.

* ``torch`` as seen by ``megatron.core.optimizer.{optimizer,clip_grads,grad_scaler}`` and
  ``megatron.core.pipeline_parallel.schedules`` -> a
  proxy of the torch module whose tensor factories (``tensor``, ``zeros``, ``ones``, ``empty``,
  ``full``) map ``device="cuda"`` to the CPU; every other attribute is the real torch. Those
  modules build scalars with a hard-coded ``device='cuda'`` (``FP32Optimizer._scale``, the
  mixed-precision optimizer's ``found_inf``, grad-norm/overflow buffers in grad clipping, the
  grad scalers, the pipeline schedules' token counter). Nothing outside these modules sees the
  proxy. (The pipeline's point-to-point sends need nothing more: they allocate through
  ``torch.cuda.current_device`` and run on gloo.)
* ``clip_grad_by_total_norm_fp32`` as imported by ``megatron.core.optimizer.optimizer`` -> the
  same clipping (scale every fp32 grad in place by ``max_norm / (total_norm + 1e-6)`` when
  that is below 1) without megatron's ``param.grad.type() == 'torch.cuda.FloatTensor'``
  assert, which a CPU fp32 grad (``'torch.FloatTensor'``) fails.
* ``l2_norm_impl`` in ``megatron.core.optimizer.clip_grads`` -> the same L2 norm over all grads
  as megatron's no-apex fallback ``megatron.core.utils.local_multi_tensor_l2_norm``, returned
  on the CPU (the fallback copies it to ``device="cuda"``). It feeds the grad norm that the
  optimizer reports and clips by.

* ``DistributedOptimizer.__init__`` and ``Float16OptimizerWithFloat16Params.__init__`` (bf16) ->
  the same constructors, run while ``Tensor.type()``
  (no arguments, CPU tensor) answers with the CUDA type name (``'torch.cuda.FloatTensor'``).
  It sorts parameters into fp32 / fp16 / bf16 groups by those names and raises on anything
  else; the names are all it reads.

Enough for megatron's ``DistributedDataParallel`` (``DistributedDataParallelConfig``, buffers
placed through ``torch.cuda.current_device`` above, no overlap / communication stream),
``get_megatron_optimizer`` with the plain or the distributed fp32 optimizer, and
``dist_checkpointing`` save/load (which also needs ``psutil`` installed). Not covered:
``overlap_grad_reduce`` (CUDA streams) and optimizer CPU offloading.

Every redirect replaces a private function or module global of megatron-core 0.16.1 (the
version pyproject.toml pins). :func:`apply_cpu_shim` refuses a megatron-core that lacks one of
them, and warns when the version differs but all are there.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from rlhpc.errors import RlhpcError

log = logging.getLogger(__name__)

_ORIGINALS: dict[str, Any] = {}

# The release the redirects were written against and tested with.
TESTED_MEGATRON_CORE = "0.16.1"
# What apply_cpu_shim replaces or reads, by module: with any of these gone it cannot work.
_REPLACED = {
    "megatron.core.fusions.fused_softmax": ("get_default_causal_mask",),
    "megatron.core.optimizer.optimizer": ("torch", "clip_grad_by_total_norm_fp32", "Float16OptimizerWithFloat16Params"),
    "megatron.core.optimizer.clip_grads": ("torch", "l2_norm_impl"),
    "megatron.core.optimizer.grad_scaler": ("torch",),
    "megatron.core.pipeline_parallel.schedules": ("torch",),
    "megatron.core.optimizer.distrib_optimizer": ("DistributedOptimizer",),
    "megatron.core.tensor_parallel.random": (
        "CudaRNGStatesTracker",
        "initialize_rng_tracker",
        "_MODEL_PARALLEL_RNG_TRACKER_NAME",
    ),
}


def megatron_core_version() -> str:
    """The installed megatron-core's version ("unknown" when its metadata is missing)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_megatron_core(version: str, import_module: Callable[[str], Any] = importlib.import_module) -> None:
    """Raise when megatron-core lacks something the shim replaces (it would certainly break);
    warn when only the version differs from the tested one (it may break in subtler ways)."""
    missing = []
    for name, attrs in _REPLACED.items():
        try:
            module = import_module(name)
        except ImportError:
            missing.append(name)
            continue
        missing += [f"{name}.{attr}" for attr in attrs if not hasattr(module, attr)]
    if missing:
        raise RlhpcError(
            f"the megatron CPU shim (rlhpc/actor/megatron/cpu_shim.py) cannot run on megatron-core {version}: "
            f"it replaces {', '.join(missing)}, which this version lacks (it is written for {TESTED_MEGATRON_CORE})",
            f"pip install megatron-core=={TESTED_MEGATRON_CORE}, or run the megatron actor on GPUs (no shim there)",
        )
    if version != TESTED_MEGATRON_CORE:
        log.warning(
            "megatron-core %s is installed; the megatron CPU shim is written for %s and replaces its "
            "internals, so CPU runs of the megatron actor may fail or train differently: "
            "pip install megatron-core==%s if they do",
            version, TESTED_MEGATRON_CORE, TESTED_MEGATRON_CORE,
        )  # fmt: skip


def _cpu_current_device() -> str:
    return "cpu"


def _cpu_synchronize(device: Any = None) -> None:
    """Nothing to wait for: CPU ops are synchronous."""


@functools.lru_cache
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


# megatron.core.optimizer modules that build tensors with a hard-coded device='cuda'.
_CUDA_FACTORY_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.pipeline_parallel.schedules",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


def _on_cpu(factory: Any) -> Any:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapper


class _CpuFactoryTorch(types.ModuleType):
    """The torch module, except that its tensor factories put ``device="cuda"`` on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _cpu_clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """megatron's ``clip_grad_by_total_norm_fp32`` without its CUDA tensor-type assert."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            assert grad.dtype in (torch.float32, torch.bfloat16), grad.dtype
            grads.append(grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.mul_(clip_coeff)


def _cpu_multi_tensor_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: Any, per_tensor: bool, *args: Any):
    """megatron's ``local_multi_tensor_l2_norm`` (the no-apex fallback), returning a CPU tensor."""
    norms = [torch.linalg.vector_norm(t) for tensors in tensor_lists for t in tensors]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    return total.reshape(1).float(), None


@contextlib.contextmanager
def _cuda_type_names():
    """While active, ``cpu_tensor.type()`` returns the CUDA type name (``torch.cuda.FloatTensor``)."""
    original = torch.Tensor.type

    def cuda_named_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if not args and not kwargs and self.device.type == "cpu":
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    torch.Tensor.type = cuda_named_type
    try:
        yield
    finally:
        torch.Tensor.type = original


def _type_checking_optimizers() -> tuple[type, ...]:
    """The optimizers whose constructors sort parameters by their CUDA type name."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    return DistributedOptimizer, Float16OptimizerWithFloat16Params


def _init_with_cuda_type_names(original: Any) -> Any:
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with _cuda_type_names():
            original(self, *args, **kwargs)

    return init


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
    check_megatron_core(megatron_core_version())
    from megatron.core.fusions import fused_softmax
    from megatron.core.optimizer import clip_grads as mclip
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.tensor_parallel import random as mrandom

    for cls in _type_checking_optimizers():
        _ORIGINALS[f"{cls.__name__}.__init__"] = cls.__init__
        cls.__init__ = _init_with_cuda_type_names(cls.__init__)
    cpu_torch = _CpuFactoryTorch()
    for name in _CUDA_FACTORY_MODULES:
        module = importlib.import_module(name)
        _ORIGINALS[f"torch@{name}"] = module.torch
        module.torch = cpu_torch
    _ORIGINALS["clip_grad_by_total_norm_fp32"] = moptimizer.clip_grad_by_total_norm_fp32
    _ORIGINALS["l2_norm_impl"] = mclip.l2_norm_impl
    mclip.l2_norm_impl = _cpu_multi_tensor_l2_norm
    moptimizer.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
    _ORIGINALS["get_default_causal_mask"] = fused_softmax.get_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    _ORIGINALS["current_device"] = torch.cuda.current_device
    _ORIGINALS["synchronize"] = torch.cuda.synchronize
    torch.cuda.synchronize = _cpu_synchronize
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
    from megatron.core.optimizer import clip_grads as mclip
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.tensor_parallel import random as mrandom

    for cls in _type_checking_optimizers():
        cls.__init__ = _ORIGINALS.pop(f"{cls.__name__}.__init__")
    for name in _CUDA_FACTORY_MODULES:
        importlib.import_module(name).torch = _ORIGINALS.pop(f"torch@{name}")
    moptimizer.clip_grad_by_total_norm_fp32 = _ORIGINALS.pop("clip_grad_by_total_norm_fp32")
    mclip.l2_norm_impl = _ORIGINALS.pop("l2_norm_impl")
    fused_softmax.get_default_causal_mask = _ORIGINALS.pop("get_default_causal_mask")
    torch.cuda.current_device = _ORIGINALS.pop("current_device")
    torch.cuda.synchronize = _ORIGINALS.pop("synchronize")
    mrandom.CudaRNGStatesTracker = _ORIGINALS.pop("CudaRNGStatesTracker")
    mrandom.initialize_rng_tracker(force_reset=True)
