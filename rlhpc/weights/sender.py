"""The weight channel actor rank 0 opens: the transport placement calls for, over the engines' clients."""

from __future__ import annotations

from rlhpc.weights.broadcast import DistributedWeightSender
from rlhpc.weights.shared_memory import TensorWeightSender
from rlhpc.wire.client import EngineClient
from rlhpc.wire.engine_key import read_key


def engine_clients(engine_urls: list[str], key_file: str | None) -> list[EngineClient]:
    """One client per engine, each sending the job's engine key (``rlhpc.wire.engine_key``)."""
    key = read_key(key_file) if key_file else None
    return [EngineClient(url, api_key=key) for url in engine_urls]


def make_weight_sender(
    clients: list[EngineClient],
    engine_world_sizes: list[int],
    colocate: bool,
    master_address: str,
    backend: str,
    bucket_bytes: int,
    pause_mode: str = "abort",
) -> DistributedWeightSender | TensorWeightSender:
    """The channel placement calls for: shared memory when colocated, a broadcast group otherwise.
    ``pause_mode``: how generation pauses for a push (``SenderBase.pause_mode``)."""
    sender: DistributedWeightSender | TensorWeightSender
    if colocate:
        sender = TensorWeightSender(clients, engine_world_sizes, bucket_bytes)
    else:
        sender = DistributedWeightSender(clients, engine_world_sizes, master_address, backend, bucket_bytes)
    sender.pause_mode = pause_mode
    return sender
