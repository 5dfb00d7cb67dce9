"""The extra torch.distributed group that carries weights from the trainer's rank 0 to the engines.

Both ends use it: the trainer (``rlhpc.rollout.weight_sync``) binds the store and joins as rank 0,
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
) -> dist.TCPStore:
    """Rank 0's rendezvous store, bound before anyone is told the port.

    Port 0 lets the kernel pick a free port at bind time, so there is no probe-then-bind race
    with other jobs on the node (and kernel ephemeral ports sit above Ray's worker-port range).
    """
    return dist.TCPStore(
        host_name=master_address,
        port=0,
        world_size=world_size,
        is_master=True,
        timeout=as_timedelta(timeout),
        wait_for_workers=False,  # the engines are told the port only after this returns
        multi_tenant=True,
    )


def open_groups_named(group_name: str) -> list[dist.ProcessGroup]:
    """Groups of that name this process still holds (a sender never closed, a trainer restarted)."""
    return [pg for pg, name in list(_world.pg_names.items()) if name == group_name]


def is_open(pg: dist.ProcessGroup) -> bool:
    """False once the group was destroyed (e.g. replaced by a later sender's)."""
    return pg in _world.pg_names
