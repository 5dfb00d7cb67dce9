"""The extra torch.distributed group that carries weights from the trainer's rank 0 to the engines.

Both ends use it: the trainer (``rlhpc.weights.broadcast``) binds the store and joins as rank 0,
the CPU engine server joins when told to by ``/init_weights_update_group`` (a real SGLang engine
joins with its own helper of the same semantics).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from rlhpc.util.net import tcp_url

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)


def as_timedelta(timeout: timedelta | float) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """Join a process group of its own, leaving any default group untouched.

    Same semantics as SGLang's helper of that name, so a real SGLang engine joins a group the
    trainer opened with this function and vice versa: TCP rendezvous at master_address:port
    (rank 0 hosts the store), keys under ``PrefixStore(group_name)``, the group registered with
    the identity rank map (so ``src``/``group_src`` 0 is the trainer). Rank 0 may pass a
    ``store`` it already bound (see ``create_master_store``); the address is then only logged.
    """
    timeout = as_timedelta(timeout)
    if store is None:
        store, rank, world_size = next(
            rendezvous(tcp_url(master_address, master_port), rank, world_size, timeout=timeout)
        )
        store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],  # like SGLang: not a subgroup of the default group, which may not exist at all
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    log.info(
        "joined group %r as rank %d/%d via %s:%d (%s)",
        group_name,
        rank,
        world_size,
        master_address,
        master_port,
        backend,
    )
    return pg


def create_master_store(
    master_address: str, world_size: int, timeout: timedelta | float = DEFAULT_TIMEOUT
) -> RendezvousStore:
    """Rank 0's rendezvous store, bound before anyone is told the port; ``close()`` it once formed.

    Port 0 lets the kernel pick a free port at bind time, so there is no probe-then-bind race
    with other jobs on the node (and kernel ephemeral ports sit above Ray's worker-port range).
    """
    return RendezvousStore(
        dist.TCPStore(
            host_name=master_address,
            port=0,
            world_size=world_size,
            is_master=True,
            timeout=as_timedelta(timeout),
            wait_for_workers=False,  # the engines are told the port only after this returns
            multi_tenant=True,
        )
    )


class RendezvousStore(dist.Store):
    """Rank 0's rendezvous store, open only until the group has formed.

    Anyone who reaches the port can read and write the group's keys, so it should not listen
    longer than the rendezvous needs. torch has no call to close a TCPStore, and the group
    keeps a reference to the store it was built with for its whole life; handed this wrapper
    instead, the group holds only the wrapper, and ``close()`` drops the last reference to the
    TCPStore, which stops listening. Store calls after ``close()`` fail, naming why.

    When the group has formed is the backend's business: gloo connects every pair while the
    group is built; NCCL builds its communicator (exchanging its id through the store) at the
    first collective.
    """

    def __init__(self, store: dist.TCPStore):
        super().__init__()
        self.port = store.port
        self._store: dist.TCPStore | None = store

    def close(self) -> None:
        self._store = None

    @property
    def closed(self) -> bool:
        return self._store is None

    def _open(self) -> dist.TCPStore:
        if self._store is None:
            raise RuntimeError(f"the weight sync rendezvous store (port {self.port}) was closed once the group formed")
        return self._store

    def set(self, key, value):  # noqa: ANN001, ANN201 - torch's Store signature
        return self._open().set(key, value)

    def get(self, key):  # noqa: ANN001, ANN201
        return self._open().get(key)

    def add(self, key, value):  # noqa: ANN001, ANN201
        return self._open().add(key, value)

    def compare_set(self, key, expected, desired):  # noqa: ANN001, ANN201
        return self._open().compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):  # noqa: ANN001, ANN201
        return self._open().wait(keys) if timeout is None else self._open().wait(keys, timeout)

    def check(self, keys):  # noqa: ANN001, ANN201
        return self._open().check(keys)

    def delete_key(self, key):  # noqa: ANN001, ANN201
        return self._open().delete_key(key)

    def num_keys(self):  # noqa: ANN201
        return self._open().num_keys()

    def set_timeout(self, timeout):  # noqa: ANN001, ANN201
        return self._open().set_timeout(timeout)


def formed_at_creation(backend: str) -> bool:
    """Whether a group of ``backend`` is done with its store once every rank has built it."""
    return backend != "nccl"  # NCCL: only after its first collective


def open_groups_named(group_name: str) -> list[dist.ProcessGroup]:
    """Groups of that name this process still holds (a sender never closed, a trainer restarted)."""
    return [pg for pg, name in list(_world.pg_names.items()) if name == group_name]


def is_open(pg: dist.ProcessGroup) -> bool:
    """False once the group was destroyed (e.g. replaced by a later sender's)."""
    return pg in _world.pg_names
