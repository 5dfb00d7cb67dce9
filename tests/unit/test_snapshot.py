"""Snapshot files: plain safetensors, written from one reusable buffer, summed from memory."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rlhpc.actor.snapshot import FlatTensors, read_safetensors, read_safetensors_into, safetensors_header
from rlhpc.actor.worker import flatten_optimizer, read_optimizer
from rlhpc.checkpoint import file_crc32


def mixed(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "small.int8": torch.randint(-5, 5, (3,), dtype=torch.int8, generator=g),
        "w.bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7.0),
        "w.f32": torch.randn(4, 6, generator=g)[:, ::2],  # not contiguous
        "ids.i64": torch.arange(5),
        "empty": torch.zeros(0, 4),
    }


def test_round_trip_readable_by_safetensors(tmp_path):
    flat = FlatTensors(pin=False)
    for seed in (0, 1):  # the second fill reuses the buffer
        want = mixed(seed)
        flat.fill(want, {"format": "pt"})
        size, crc = flat.write(tmp_path / "x.safetensors")
        assert size == (tmp_path / "x.safetensors").stat().st_size and crc == file_crc32(tmp_path / "x.safetensors")
        theirs = load_file(tmp_path / "x.safetensors")
        ours, metadata = read_safetensors(tmp_path / "x.safetensors")
        assert metadata == {"format": "pt"}
        with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        for name, t in want.items():
            assert torch.equal(theirs[name], t) and torch.equal(ours[name], t), name
            assert ours[name].dtype == t.dtype and ours[name].shape == t.shape


def test_the_buffer_is_a_copy(tmp_path):
    t = torch.ones(4)
    flat = FlatTensors(pin=False)
    flat.fill({"t": t})
    t.add_(1)  # training goes on after the snapshot
    flat.write(tmp_path / "x.safetensors")
    assert torch.equal(read_safetensors(tmp_path / "x.safetensors")[0]["t"], torch.ones(4))


def test_optimizer_state_round_trip(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    tensors, rest = flatten_optimizer(opt.state_dict())
    flat = FlatTensors(pin=False)
    flat.fill(tensors, {"format": "pt", "optimizer": json.dumps(rest)})
    (tmp_path / "actor").mkdir()
    flat.write(tmp_path / "actor" / "optim.safetensors")
    got = read_optimizer(tmp_path / "actor")
    want = opt.state_dict()
    assert got["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        for k, v in state.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.1, betas=(0.8, 0.9))
    fresh.load_state_dict(got)
    assert fresh.param_groups[0]["lr"] == 0.1 and list(fresh.param_groups[0]["betas"]) == [0.8, 0.9]

    # a rank that has trained reads the file into its own state tensors
    own = opt.state_dict()
    pointers = {(i, k): v.data_ptr() for i, state in own["state"].items() for k, v in state.items()}
    opt.step()  # the state moves on; the load brings it back
    again = read_optimizer(tmp_path / "actor", opt.state_dict())
    for i, k in pointers:
        assert torch.equal(again["state"][i][k], got["state"][i][k]), (i, k)
        assert again["state"][i][k].data_ptr() == pointers[i, k], (i, k)


def test_read_into_fills_the_targets_in_place(tmp_path):
    want = mixed(2)
    flat = FlatTensors(pin=False)
    flat.fill(want, {"format": "pt"})
    flat.write(tmp_path / "x.safetensors")
    entries, metadata = safetensors_header(tmp_path / "x.safetensors")
    assert sorted(entries) == sorted(want) and metadata == {"format": "pt"}
    targets = {name: torch.full_like(t, 3) for name, t in want.items()}
    targets["w.f32"] = torch.full((4, 6), 3.0)[:, ::2]  # not contiguous: read through a buffer
    targets["ids.i64"] = torch.zeros(5, dtype=torch.int32)  # another dtype: converted by copy_
    pointers = {name: t.data_ptr() for name, t in targets.items()}
    read_safetensors_into(tmp_path / "x.safetensors", targets)
    for name, t in want.items():
        assert torch.equal(targets[name], t.to(targets[name].dtype)), name
        assert targets[name].data_ptr() == pointers[name]  # the model's own tensors, not new ones

    targets["w.bf16"] = torch.zeros(3, 5, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"w.bf16 has shape \[5, 3\], the model's is \[3, 5\]"):
        read_safetensors_into(tmp_path / "x.safetensors", targets)
