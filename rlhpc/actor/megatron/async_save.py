"""megatron-core's torch_dist save, split the way rlhpc saves: a snapshot the loop waits for, a write it does not.

``TorchDistSave.plan`` runs on the train loop's thread, on every rank at the same point: megatron's
save preprocessing (factories; the sharding check, collectives on the default group), host copies
of the shards this rank writes, megatron's small common file (rank 0) and the translation to
torch.distributed.checkpoint's state dict. ``TorchDistSave.write`` then runs on the rank's
checkpoint thread while training goes on: ``torch.distributed.checkpoint.save`` of those copies
with megatron's planner (each rank writes and fsyncs its file, rank 0 the global metadata), then
megatron's ``metadata.json``, last. The files are those of ``dist_checkpointing.save``, so
``dist_checkpointing.load`` reads them and reshards as before. The writer's file system sums each
file (CRC-32, size) as its bytes go out, so the checkpoint's manifest need not read them back.

Why not megatron's own async save (``AsyncCallsQueue``): its finalize and its completion check run
collectives on the default group, which the training thread is using meanwhile; its persistent
worker is a spawned process that selects a CUDA device; its writer forks a process per file and
passes results through a spawned multiprocessing Manager (seconds to start, on the first save);
and on CPU its "preload" keeps references to the live parameters, so a write racing the optimizer
would save a mix of two steps. Here the background part's collectives run on a gloo group of its
own (made once per rank, used by one save at a time: the checkpoint manager keeps at most one in
flight), the checkpoint thread writes the file itself, and the host copies are the snapshot.
"""

# ruff: noqa: E402  (megatron-core's imports follow import_megatron_core())
from __future__ import annotations

import io
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from rlhpc.actor.megatron.lean_import import import_megatron_core

import_megatron_core()  # before megatron's modules below: a third cheaper (lean_import says why)

from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.serialization import (
    get_default_save_common_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.filesystem import FileSystem


class _Summing(io.RawIOBase):
    """A file being written, with the CRC-32 and size of everything written so far (the file's
    own, since DCP writes each file front to back without seeking)."""

    def __init__(self, raw: io.BufferedWriter):
        super().__init__()
        self.raw, self.crc, self.size = raw, 0, 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = self.raw.write(b)  # a buffered writer takes all of it or raises
        self.crc = zlib.crc32(b, self.crc)
        self.size += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()


class SummedFileSystem(FileSystem):
    """torch.distributed.checkpoint's local file system, keeping (size, CRC-32) of each file it
    writes, by final path (DCP writes its metadata under a temporary name, then renames it)."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[Path, tuple[int, int]] = {}

    @contextmanager
    def create_stream(self, path: str | Any, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            summed = _Summing(stream)  # type: ignore[arg-type]
            yield summed
        self.sums[Path(path)] = (summed.size, summed.crc)

    def rename(self, path: str | Any, new_path: str | Any) -> None:
        super().rename(path, new_path)
        if (summed := self.sums.pop(Path(path), None)) is not None:
            self.sums[Path(new_path)] = summed


class _SummingWriter(dcp.FileSystemWriter):
    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = SummedFileSystem()  # the writer's one file system: every stream it opens comes from it


class TorchDistSave:
    """One rank's side of torch_dist saves, each a ``plan`` (loop thread) then a ``write``
    (checkpoint thread). Construct on every rank at the same point (it makes a process group)."""

    def __init__(self) -> None:
        self.strategy = get_default_save_sharded_strategy()  # torch_dist, as dist_checkpointing.save uses
        self.group = dist.new_group(backend="gloo")  # the background part's collectives, apart from training's
        self._planned: tuple[str, dict[str, Any]] | None = None
        # Host copies, kept from save to save: this VM takes longer to fault fresh memory in than
        # to copy into memory already mapped (35-200 ms per 57 MB against 3-5 ms).
        self._host: list[torch.Tensor] = []

    def plan(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str) -> None:
        """Everything of a save the loop must wait for; afterwards training may change the state."""
        sharded, common = save_preprocess(sharded_state_dict)
        self._to_host(sharded)
        get_default_save_common_strategy().save_common(common, checkpoint_dir)  # rank 0, small
        sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, self.strategy.keep_only_main_replica)
        self._planned = (checkpoint_dir, mcore_to_pyt_state_dict(sharded, False))

    def _to_host(self, sharded: dict[str, Any]) -> None:
        """Point the main replicas' ShardedTensors at host copies of their data (CPU tensors too:
        the writer would read the live parameters). Copied contiguous, so megatron's own clones
        of views and of non-contiguous tensors find nothing to do."""
        shards = [x for x in nested_values(sharded) if isinstance(x, ShardedTensor) and is_main_replica(x.replica_id)]
        pin = any(x.data.is_cuda for x in shards)
        if [(h.shape, h.dtype) for h in self._host] != [(x.data.shape, x.data.dtype) for x in shards]:
            self._host = [torch.empty(x.data.shape, dtype=x.data.dtype, pin_memory=pin) for x in shards]
        for h, x in zip(self._host, shards):
            x.data = h.copy_(x.data.detach(), non_blocking=pin)
        if pin:
            torch.cuda.synchronize()

    def write(self) -> dict[Path, tuple[int, int]]:
        """Write the planned save (no collective on the default group: this runs beside training).
        Returns (size, CRC-32) of the files this rank wrote, summed as they were written."""
        if self._planned is None:
            raise RuntimeError("TorchDistSave.write without a plan")
        (checkpoint_dir, state_dict), self._planned = self._planned, None
        writer = _SummingWriter(checkpoint_dir, thread_count=1)  # written on this thread, fsynced
        dcp.save(
            state_dict,
            storage_writer=writer,
            planner=MCoreSavePlanner(
                dedup_replicated_tensors=not self.strategy.keep_only_main_replica, flatten_state_dict=False
            ),
            process_group=self.group,
        )
        if dist.get_rank() == 0:  # last: megatron takes a directory without it for no checkpoint
            save_config(CheckpointingConfig(self.strategy.backend, self.strategy.version), checkpoint_dir)
        dist.barrier(group=self.group)
        return writer.fs.sums
