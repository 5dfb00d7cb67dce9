"""Reserve the job's GPUs as one Ray placement group and learn where each bundle landed.

Ray's bundle index says nothing about node or GPU, so every bundle is probed for its
(node IP, GPU id) and slots are assigned in numeric (IP octets, GPU id) order; in a
heterogeneous job, group by group (the actor's component first), each bundle asking for its
group's resource so that Ray places it on that component's nodes.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhpc.cluster.layout import GROUP_RESOURCES
from rlhpc.errors import RlhpcError

log = logging.getLogger(__name__)


@dataclass
class Placement:
    pg: PlacementGroup
    bundle_of_slot: list[int]  # slot k -> placement-group bundle index
    location_of_slot: list[tuple[str, int]]  # slot k -> (node IP, GPU id)

    def strategy(self, slot: int) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy that pins a Ray actor to the bundle of ``slot``."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self.bundle_of_slot[slot]
        )

    def remove(self) -> None:
        remove_placement_group(self.pg)


def sort_key(location: tuple[str, int]) -> tuple[int, int]:
    """Numeric order: 10.0.0.9 before 10.0.0.10 (string order gets that wrong)."""
    ip, gpu = location
    return int(ipaddress.ip_address(ip)), int(gpu)


# A task, not an actor: an actor is a Python process of its own, started and killed for one
# answer. max_calls=0: Ray ends a task's worker after one call where the task asks for a GPU
# (its default, for GPU memory this task never touches), so each probe would start a Python
# worker (~1 CPU s) that answers once and exits; kept, one worker answers a node's probes.
@ray.remote(num_cpus=0.01, num_gpus=0.01, max_calls=0)
def _where() -> tuple[str, int]:
    gpu_ids = ray.get_gpu_ids()
    return ray.util.get_node_ip_address(), int(gpu_ids[0]) if gpu_ids else -1


def create_placement(num_slots: int, groups: Sequence[int] | None = None, timeout_s: float = 120.0) -> Placement:
    """``groups``: slot -> group (``Layout.slot_groups``) in a heterogeneous job, else None."""
    groups = list(groups) if groups is not None else [0] * num_slots
    hetero = any(groups)
    bundles = [{"GPU": 1, "CPU": 1, **({GROUP_RESOURCES[g]: 1} if hetero else {})} for g in groups]
    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        res = ray.cluster_resources()
        remove_placement_group(pg)
        have = ", ".join(f"{k}={res.get(k, 0):g}" for k in ("GPU", "CPU", *(GROUP_RESOURCES if hetero else ())))
        raise RlhpcError(
            f"Ray could not reserve {num_slots} GPUs within {timeout_s:.0f}s (cluster has {have})",
            "check that every node joined Ray with its GPUs, or shrink the layout",
        )
    locations = _probe(pg, num_slots)
    order = sorted(range(num_slots), key=lambda i: (groups[i], *sort_key(locations[i])))
    placement = Placement(pg, order, [locations[i] for i in order])
    log.info("placement: %s", ", ".join(f"slot{k}={ip}:gpu{g}" for k, (ip, g) in enumerate(placement.location_of_slot)))
    return placement


def _probe(pg: PlacementGroup, num_slots: int) -> list[tuple[str, int]]:
    """Each bundle's (node IP, GPU id): the nodes in parallel, a node's bundles one after another,
    so that one worker per node answers them all (probes sent at once would each start one)."""
    node_of = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    by_node: dict[str, list[int]] = {}
    for i in range(num_slots):
        by_node.setdefault(node_of[i], []).append(i)
    locations: list[tuple[str, int]] = [("", -1)] * num_slots
    for turn in range(max(len(b) for b in by_node.values())):
        batch = [b[turn] for b in by_node.values() if turn < len(b)]
        answers = ray.get(
            [
                _where.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=i
                    )
                ).remote()
                for i in batch
            ]
        )
        for i, answer in zip(batch, answers, strict=True):
            locations[i] = answer
    return locations
