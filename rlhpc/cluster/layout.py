"""Which GPU slots the actor ranks and the rollout engines get: a pure function of the config.

Slots are logical GPU indices 0..N-1 of the job. After placement (see ``placement.py``) slot
``k`` is the k-th GPU in (node IP, GPU id) order, so slot k lives on node ``k // gpus_per_node``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhpc.config import ClusterConfig


@dataclass(frozen=True)
class Layout:
    num_slots: int  # GPUs (placement-group bundles) the job reserves
    actor_slots: tuple[int, ...]  # slot of actor rank r
    engine_slots: tuple[tuple[int, ...], ...]  # slots of engine e (tensor-parallel group)
    colocate: bool

    @property
    def rollout_slots(self) -> tuple[int, ...]:
        return tuple(s for engine in self.engine_slots for s in engine)


def plan_layout(c: ClusterConfig) -> Layout:
    """Actor first, rollout after it (disaggregated) or on the same slots (colocate)."""
    actor = tuple(range(c.actor_num_gpus))
    offset = 0 if c.colocate else c.actor_num_gpus
    per = c.rollout_gpus_per_engine
    engines = tuple(tuple(range(offset + e * per, offset + (e + 1) * per)) for e in range(c.rollout_num_gpus // per))
    num_slots = max(actor[-1], engines[-1][-1]) + 1
    return Layout(num_slots=num_slots, actor_slots=actor, engine_slots=engines, colocate=c.colocate)


def slot_location(slot: int, gpus_per_node: int) -> tuple[int, int]:
    """(node index, GPU index on that node) of a slot, for plans printed before submission."""
    return slot // gpus_per_node, slot % gpus_per_node


def describe_layout(layout: Layout, gpus_per_node: int, node_names: list[str] | None = None) -> str:
    """Human-readable plan: which node/GPU each actor rank and each engine gets."""

    def where(slot: int) -> str:
        node, gpu = slot_location(slot, gpus_per_node)
        name = node_names[node] if node_names and node < len(node_names) else f"node{node}"
        return f"{name}:gpu{gpu}"

    mode = "colocated (actor and engines share GPUs)" if layout.colocate else "disaggregated"
    lines = [f"GPU layout: {layout.num_slots} GPUs, {mode}"]
    for rank, slot in enumerate(layout.actor_slots):
        lines.append(f"  actor rank {rank:<3d} -> {where(slot)}")
    for e, slots in enumerate(layout.engine_slots):
        lines.append(f"  engine {e:<3d} (tp={len(slots)}) -> {', '.join(where(s) for s in slots)}")
    return "\n".join(lines)
