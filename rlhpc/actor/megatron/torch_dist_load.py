"""megatron-core's torch_dist load, reading each stored tensor straight into the tensor it restores.

megatron's own load (``TorchDistLoadShardedStrategy`` with torch.distributed.checkpoint's
``FileSystemReader``) ``torch.load``s every stored tensor into a new buffer, in plan order, and
copies it into the model's tensor; then it concatenates the two halves of every gated-MLP weight
(and of each of its Adam moments) into a third buffer, which ``load_state_dict`` copies back.
On a host where fresh memory is slow to fault in, that took three to five times a plain read.

Here (``load``): the same files, plan, resharding and checks, but

- ``DirectReader`` reads a stored tensor's bytes straight into its target when they are the
  same bytes (same dtype and shape, both contiguous, the whole stored chunk: the same layout,
  or a resharded one split along the first dimension), each file in offset order so a cold
  read streams; anything else (a narrowed chunk, a target on a GPU, a tensor subclass, a
  stream transform) takes DCP's own path;
- ``in_place_merges``: a factory whose pieces were loaded into views that tile its tensor, in
  order, already holds the merged tensor: its merge returns that tensor instead of a copy.
"""

# ruff: noqa: E402  (megatron-core's imports follow import_megatron_core())
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from rlhpc.actor.megatron.lean_import import import_megatron_core

import_megatron_core()  # before megatron's modules below: a third cheaper (lean_import says why)

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from rlhpc.actor.snapshot import read_exactly


def load(sharded_state_dict: dict[str, Any], checkpoint_dir: str) -> dict[str, Any]:
    """``dist_checkpointing.load`` of a torch_dist checkpoint, through ``DirectReader``."""
    return dist_checkpointing.load(in_place_merges(sharded_state_dict), checkpoint_dir, TorchDistLoad())


class DirectReader(CachedMetadataFileSystemReader):
    """DCP's file reader, reading stored tensors into their targets without a buffer between."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        rest: list[ReadItem] = []
        for relative_path, reqs in per_file.items():
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)  # one pass front to back
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                rest += [req for req in reqs if not self._read_direct(stream, req, planner)]
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_direct(self, stream: Any, req: ReadItem, planner: LoadPlanner) -> bool:
        """Read ``req`` into its target if its stored bytes are the target's; False: not done."""
        info = self.storage_data[req.storage_index]
        if req.type != LoadItemType.TENSOR or info.transform_descriptors:
            return False
        # Plain tensors only: a tensor subclass (FP8) lays out its bytes its own way, and megatron's
        # planner keeps one between resolve_tensor and commit_tensor (the next call must commit it).
        lookup = getattr(planner, "lookup_tensor", None)  # DefaultLoadPlanner's, which megatron's extends
        if lookup is None or type(lookup(req.dest_index)) not in (torch.Tensor, torch.nn.Parameter):
            return False
        target = planner.resolve_tensor(req).detach()
        if target.device.type != "cpu" or not target.is_contiguous():
            return False
        # torch.load to the meta device reads the stored tensor's layout and where its bytes
        # start, not the bytes themselves
        stored = torch.load(self._slice_file(stream, info), map_location="meta", weights_only=True)
        start = getattr(stored.untyped_storage(), "_checkpoint_offset", None)
        same_bytes = (
            start is not None
            and stored.is_contiguous()
            and stored.storage_offset() == 0
            and stored.dtype == target.dtype
            and stored.shape == target.shape
            and list(req.lengths) == list(stored.shape)
            and not any(req.storage_offsets)
        )
        if not same_bytes:
            return False
        stream.seek(info.offset + start)
        read_exactly(stream, Path(self.path) / info.relative_path, target)
        planner.commit_tensor(req, target)
        return True


class TorchDistLoad(TorchDistLoadShardedStrategy):
    """megatron's torch_dist load strategy with ``DirectReader`` as its storage reader."""

    def load(self, sharded_state_dict: dict[str, Any], checkpoint_dir: Path) -> dict[str, Any]:
        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        planner = MCoreLoadPlanner(
            shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
            allow_shape_mismatch_sharded_tensors={t.key: t for t in tensors if t.allow_shape_mismatch},
        )
        keyed, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(keyed, True)
        reader = DirectReader(checkpoint_dir)
        dcp.load(pyt_state_dict, storage_reader=reader, planner=planner)
        self.cached_global_metadata = reader.read_metadata()  # cached: no second read
        loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, sharded_state_dict)
        return loaded


def in_place_merges(sharded_state_dict: dict[str, Any]) -> dict[str, Any]:
    """Give every factory a merge that returns its own tensor when the loaded pieces tile it."""

    def with_in_place_merge(x: Any) -> Any:
        if not isinstance(x, ShardedTensorFactory):
            return x
        return dataclasses.replace(x, merge_fn=_merge_in_place(x.data, x.merge_fn))

    return dict_list_map_inplace(with_in_place_merge, sharded_state_dict)


def _merge_in_place(data: torch.Tensor, merge: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    def merge_fn(sub_state_dict: Any) -> torch.Tensor:
        return data if tiles(data, list(nested_values(sub_state_dict))) else merge(sub_state_dict)

    return merge_fn


def tiles(data: torch.Tensor, pieces: list[Any]) -> bool:
    """``pieces`` are contiguous views of ``data``'s memory that cover it front to back, in order
    (what ``torch.chunk`` along the first dimension makes): concatenated, they are ``data``."""
    if not pieces or not data.is_contiguous():
        return False
    at = data.storage_offset()
    for p in pieces:
        if not (
            isinstance(p, torch.Tensor)
            and p.dtype == data.dtype
            and p.is_contiguous()
            and p.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
            and p.storage_offset() == at
            and p.shape[1:] == data.shape[1:]
        ):
            return False
        at += p.numel()
    return at == data.storage_offset() + data.numel()
