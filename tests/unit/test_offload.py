"""StorageOffloader on CPU storages: the mechanism the megatron actor uses on the GPU."""

import pytest
import torch

from rlhpc.actor.offload import StorageOffloader


def test_offload_frees_storages_and_onload_restores_every_view():
    buffer = torch.arange(24, dtype=torch.float32)
    view = buffer[4:16].view(3, 4)  # a parameter living inside a grad/param buffer
    alias = buffer[4:16].view(3, 4)  # e.g. param.main_grad: another view of the same bytes
    param = torch.nn.Parameter(torch.randn(5, 5))
    expected = {"buffer": buffer.clone(), "param": param.detach().clone()}
    o = StorageOffloader()

    freed = o.offload([view, buffer, alias, param])
    assert freed == buffer.numel() * 4 + param.numel() * 4  # each storage once
    assert buffer.untyped_storage().nbytes() == 0 and param.untyped_storage().nbytes() == 0
    # While offloaded the bytes are readable through host views with the same layout.
    assert torch.equal(o.host_view(view), expected["buffer"][4:16].view(3, 4))
    assert torch.equal(o.host_view(param.detach()), expected["param"])
    with pytest.raises(RuntimeError, match="already offloaded"):
        o.offload([buffer])

    o.onload()
    assert not o.active
    assert torch.equal(buffer, expected["buffer"]) and torch.equal(param.detach(), expected["param"])
    view.add_(1)  # still a view of the restored storage
    assert torch.equal(alias, expected["buffer"][4:16].view(3, 4) + 1)
    other = torch.ones(3)
    assert o.host_view(other) is other  # not offloaded: the tensor itself
