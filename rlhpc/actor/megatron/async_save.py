"""megatron-core's torch_dist save, split the way rlhpc saves: a snapshot the loop waits for, a write it does not.

``TorchDistSave.plan`` runs on the train loop's thread, on every rank at the same point: megatron's
save preprocessing (factories; the sharding check, collectives on the default group), host copies
of the shards this rank writes, megatron's small common file (rank 0) and the translation to
torch.distributed.checkpoint's state dict. ``TorchDistSave.write`` then runs on the rank's
checkpoint thread while training goes on: ``torch.distributed.checkpoint.save`` of those copies
with megatron's planner (each rank writes and fsyncs its file, rank 0 the global metadata), then
megatron's ``metadata.json``, last. The files are those of ``dist_checkpointing.save``, so
``dist_checkpointing.load`` reads them and reshards as before.

Why not megatron's own async save (``AsyncCallsQueue``): its finalize and its completion check run
collectives on the default group, which the training thread is using meanwhile; its persistent
worker is a spawned process that selects a CUDA device; its writer forks a process per file and
passes results through a spawned multiprocessing Manager (seconds to start, on the first save);
and on CPU its "preload" keeps references to the live parameters, so a write racing the optimizer
would save a mix of two steps. Here the background part's collectives run on a gloo group of its
own (made once per rank, used by one save at a time: the checkpoint manager keeps at most one in
flight), the checkpoint thread writes the file itself, and the host copies are the snapshot.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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

    def write(self) -> None:
        """Write the planned save (no collective on the default group: this runs beside training)."""
        if self._planned is None:
            raise RuntimeError("TorchDistSave.write without a plan")
        (checkpoint_dir, state_dict), self._planned = self._planned, None
        dcp.save(
            state_dict,
            storage_writer=dcp.FileSystemWriter(checkpoint_dir, thread_count=1),  # written on this thread, fsynced
            planner=MCoreSavePlanner(
                dedup_replicated_tensors=not self.strategy.keep_only_main_replica, flatten_state_dict=False
            ),
            process_group=self.group,
        )
        if dist.get_rank() == 0:  # last: megatron takes a directory without it for no checkpoint
            save_config(CheckpointingConfig(self.strategy.backend, self.strategy.version), checkpoint_dir)
        dist.barrier(group=self.group)
