"""The megatron actor's checkpoint reader: stored tensors read straight into their targets where
the bytes are the same, DCP's own path elsewhere, the same values either way; and gated-MLP
merges that return the tensor the halves were loaded into."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("megatron.core")

from rlhpc.actor.megatron.torch_dist_load import DirectReader, tiles  # noqa: E402


class RecordingReader(DirectReader):
    """Which reads went straight into their targets (True) and which took DCP's path (False)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reads: list[tuple[str, tuple[int, ...], tuple[int, ...], bool]] = []

    def _read_direct(self, stream, req, planner) -> bool:
        done = super()._read_direct(stream, req, planner)
        self.reads.append((req.storage_index.fqn, tuple(req.storage_index.offset), tuple(req.lengths), done))
        return done

    @property
    def direct(self) -> dict[str, bool]:
        return {fqn: done for fqn, _, _, done in self.reads}


@pytest.fixture
def saved(tmp_path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(64, 32, generator=g),
        "bf16": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "cols": torch.randn(8, 6, generator=g),
    }
    with warnings.catch_warnings():  # one process, no process group: DCP says so
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt"))
    return state


def load(path: Path, targets: dict[str, torch.Tensor]) -> RecordingReader:
    reader = RecordingReader(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=reader)
    return reader


def test_stored_tensors_are_read_straight_into_their_targets(tmp_path: Path, saved) -> None:
    targets = {k: torch.full_like(v, 3) for k, v in saved.items()}
    kept = {k: v.data_ptr() for k, v in targets.items()}
    reader = load(tmp_path / "ckpt", targets)
    assert reader.direct == {k: True for k, v in saved.items() if v.numel()}  # DCP reads nothing for "empty"
    for k, v in saved.items():
        assert targets[k].data_ptr() == kept[k]  # loaded in place
        assert torch.equal(targets[k], v), k


def test_targets_of_another_layout_take_dcps_own_path(tmp_path: Path, saved) -> None:
    """A non-contiguous target, one of another dtype and a tensor subclass (FP8 tensors are
    one) are not plainly the stored bytes: DCP's path loads them (converting the dtype), the
    rest still goes straight in."""

    class Tagged(torch.Tensor):
        pass

    cols = torch.zeros(6, 8).t()  # same shape, transposed memory
    targets = {
        "w": torch.zeros(64, 32, dtype=torch.float64),
        "cols": cols,
        "step": torch.tensor(0, dtype=torch.int64).as_subclass(Tagged),
        "bf16": torch.zeros(17, 5, dtype=torch.bfloat16),
    }
    reader = load(tmp_path / "ckpt", targets)
    assert reader.direct == {"w": False, "cols": False, "step": False, "bf16": True}
    assert torch.equal(targets["w"], saved["w"].double())
    assert torch.equal(cols, saved["cols"])
    assert int(targets["step"]) == 7
    assert torch.equal(targets["bf16"], saved["bf16"])


def test_a_resharded_load_reads_whole_stored_chunks_directly(tmp_path: Path) -> None:
    """Saved as two row shards (two ranks' pieces), loaded as one whole shard: each stored chunk
    goes straight into its rows of the target. Loaded as other row shards: a stored chunk split
    over two targets takes DCP's narrowing path; the values are right either way."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    full = torch.arange(48.0).reshape(8, 6)

    def rows(*bounds: tuple[int, int], src: torch.Tensor):
        shards = [Shard(src[r0:r1].clone(), ShardMetadata([r0, 0], [r1 - r0, 6], "rank:0/cpu")) for r0, r1 in bounds]
        return init_from_local_shards(shards, list(full.shape))

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"t": rows((0, 4), (4, 8), src=full)}, storage_writer=dcp.FileSystemWriter(tmp_path / "a"))
        whole = rows((0, 8), src=torch.zeros(8, 6))
        assert sorted(load(tmp_path / "a", {"t": whole}).reads) == [
            ("t", (0, 0), (4, 6), True),
            ("t", (4, 0), (4, 6), True),
        ]
        assert torch.equal(whole.local_shards()[0].tensor, full)
        other = rows((0, 2), (2, 8), src=torch.zeros(8, 6))
        assert sorted(load(tmp_path / "a", {"t": other}).reads) == [
            ("t", (0, 0), (2, 6), False),  # rows 0-1 of the first chunk
            ("t", (0, 0), (2, 6), False),  # rows 2-3 of it
            ("t", (4, 0), (4, 6), True),
        ]
        assert torch.equal(torch.cat([s.tensor for s in other.local_shards()]), full)
    finally:
        torch.distributed.destroy_process_group()


def test_tiles() -> None:
    t = torch.arange(24.0).reshape(6, 4)
    assert tiles(t, list(torch.chunk(t, 2)))
    assert tiles(t, [t])
    assert not tiles(t, list(torch.chunk(t, 2))[::-1])  # out of order
    assert not tiles(t, list(torch.chunk(t, 2, dim=1)))  # column halves: not contiguous
    assert not tiles(t, [c.clone() for c in torch.chunk(t, 2)])  # copies, not views
    assert not tiles(t, [torch.chunk(t, 2)[0]])  # half of it
    assert not tiles(t.t(), list(torch.chunk(t.t(), 2)))  # a non-contiguous tensor
    assert not tiles(t, [])
