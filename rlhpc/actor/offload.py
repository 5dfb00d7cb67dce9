"""Free a rank's GPU memory around generation while every tensor object stays valid.

Megatron keeps parameters, gradients and optimizer state as views into a few large buffers
(and models hold references everywhere), so moving tensors one by one would break those
links. Instead each distinct *storage* is copied to (pinned) host memory and shrunk to zero
bytes; onload grows it back and copies the bytes in. Views, ``main_grad`` aliases and
optimizer references never change identity. This is what megatron-core's own
``_ParamAndGradBuffer.offload_to_cpu`` does for its buffers, applied to every tensor a rank owns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)


class StorageOffloader:
    """Offload/onload the storages behind a set of tensors (any device; meant for CUDA)."""

    def __init__(self) -> None:
        # storage identity -> (storage, host copy); empty when onloaded. ``_cdata`` is the
        # address of the storage object itself: unlike data_ptr it survives ``resize_``.
        self._offloaded: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}

    @property
    def active(self) -> bool:
        return bool(self._offloaded)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy each distinct storage to host memory and free it; returns the bytes freed."""
        if self._offloaded:
            raise RuntimeError("already offloaded")
        freed = 0
        pin = torch.cuda.is_available()
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if storage.nbytes() == 0 or key in self._offloaded:
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.untyped_storage().copy_(storage)
            self._offloaded[key] = (storage, host)
            freed += storage.nbytes()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # copies done before the memory is handed back
        for storage, _ in self._offloaded.values():
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.debug("offloaded %d storages, %.1f MB", len(self._offloaded), freed / 2**20)
        return freed

    def host_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself when onloaded; else the same view (offset, shape, stride) on its host copy."""
        entry = self._offloaded.get(t.untyped_storage()._cdata)
        if entry is None:
            return t
        out = torch.empty(0, dtype=t.dtype, device="cpu")
        out.set_(entry[1].untyped_storage(), t.storage_offset(), t.shape, t.stride())
        return out

    def onload(self) -> None:
        """Grow every storage back and copy its bytes in."""
        for storage, host in self._offloaded.values():
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._offloaded.clear()
