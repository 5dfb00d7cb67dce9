"""Which GPU slots the actor ranks and the rollout engines get: a pure function of the config.

Slots are logical GPU indices 0..N-1 of the job. After placement (see ``placement.py``) slot
``k`` is the k-th GPU in (node IP, GPU id) order, so slot k lives on node ``k // gpus_per_node``.
In a heterogeneous job (``cluster.rollout_nodes``) each slot also belongs to a group: the actor's
slots to component 0, the engines' to component 1, the reward engines' to component 2 (when
``cluster.reward_nodes`` gives them one), each group in its own (IP, GPU) order; the Ray nodes of each component offer ``GROUP_RESOURCES[group]`` and each bundle asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhpc.config import ClusterConfig, Config, RewardModelConfig, TeacherConfig
from rlhpc.errors import ConfigError

# Ray custom resources that pin each group's bundles to its component of a heterogeneous job.
GROUP_RESOURCES = ("rlhpc_actor_node", "rlhpc_rollout_node", "rlhpc_reward_node")


@dataclass(frozen=True)
class Layout:
    num_slots: int  # GPUs (placement-group bundles) the job reserves
    actor_slots: tuple[int, ...]  # slot of actor rank r
    engine_slots: tuple[tuple[int, ...], ...]  # slots of engine e (tensor-parallel group)
    colocate: bool
    node_gpus: tuple[int, ...]  # GPUs of each node of the allocation, in order
    slot_homes: tuple[tuple[int, int], ...]  # slot -> (node index, GPU index): the plan before placement
    slot_groups: tuple[int, ...]  # slot -> its group (0 for every slot unless heterogeneous)
    # slots of reward engine e: a third group, frozen (no weight pushes), after the others' GPUs
    reward_slots: tuple[tuple[int, ...], ...] = ()
    # slots of teacher engine e: frozen too, after the reward engines'
    teacher_slots: tuple[tuple[int, ...], ...] = ()

    @property
    def heterogeneous(self) -> bool:
        return any(self.slot_groups)


def frozen_groups(
    reward: RewardModelConfig | None, teacher: TeacherConfig | None
) -> list[RewardModelConfig | TeacherConfig]:
    return [s for s in (reward, teacher) if s is not None]


def plan_layout(
    c: ClusterConfig, reward: RewardModelConfig | None = None, teacher: TeacherConfig | None = None
) -> Layout:
    """Actor first, rollout after it (disaggregated, or on the engines' own nodes in a
    heterogeneous job) or on the same slots (colocate); the frozen engines on GPUs of their own
    after both, in either mode: the reward model's (``reward``), then the teacher's. In a
    heterogeneous job the reward model's GPUs are a component of their own, not taken off the others."""
    taken = frozen_groups(reward if c.reward_nodes is None else None, teacher)
    reserved = sum(s.num_gpus for s in taken)
    actor_gpus, rollout_gpus = c.split(reserved=reserved)  # as resolved by the config (an open split: the default)
    actor = tuple(range(actor_gpus))
    offset = 0 if c.colocate else actor_gpus
    per = c.rollout_gpus_per_engine
    engines = tuple(tuple(range(offset + e * per, offset + (e + 1) * per)) for e in range(rollout_gpus // per))
    num_slots = max(actor[-1], engines[-1][-1]) + 1
    frozen: list[tuple[tuple[int, ...], ...]] = []
    for group in (reward, teacher):
        if group is None:
            frozen.append(())
            continue
        per = group.gpus_per_engine
        frozen.append(
            tuple(tuple(range(num_slots + e * per, num_slots + (e + 1) * per)) for e in range(group.num_engines))
        )
        num_slots += group.num_gpus
    rewards, teachers = frozen
    if c.heterogeneous:  # the engines' slots count from the first GPU of the rollout component
        homes = [(k // c.gpus_per_node, k % c.gpus_per_node) for k in actor]
        homes += [(c.num_nodes + j // c.rollout_node_gpus, j % c.rollout_node_gpus) for j in range(rollout_gpus)]
        groups = (0,) * actor_gpus + (1,) * rollout_gpus
        if rewards:  # validation saw to it that a het job's reward engines have a component of their own
            first = c.num_nodes + (c.rollout_nodes or 0)
            homes += [(first + j // c.reward_node_gpus, j % c.reward_node_gpus) for j in range(reward.num_gpus)]
            groups += (2,) * reward.num_gpus
    else:
        homes = [(k // c.gpus_per_node, k % c.gpus_per_node) for k in range(num_slots)]
        groups = (0,) * num_slots
    return Layout(num_slots, actor, engines, c.colocate, c.node_gpus, tuple(homes), groups, rewards, teachers)


def check_homes(cfg: Config) -> None:
    """Each reward and teacher engine's GPUs are on one node (the groups before it may leave a partial one)."""
    c = cfg.cluster
    layout = plan_layout(c, cfg.reward_model, cfg.teacher)
    for e, slots in enumerate(layout.reward_slots):
        if len({layout.slot_homes[s][0] for s in slots}) > 1:
            raise ConfigError(
                f"reward engine {e} would straddle two nodes (slots {list(slots)}, "
                f"{c.gpus_per_node} GPUs per node): the groups before it leave a partial node",
                "make the actor and rollout GPUs a multiple of reward_model.gpus_per_engine, or use gpus_per_engine 1",
            )
    for e, slots in enumerate(layout.teacher_slots):
        if len({layout.slot_homes[s][0] for s in slots}) > 1:
            raise ConfigError(
                f"teacher engine {e} would straddle two nodes (slots {list(slots)}, {c.gpus_per_node} GPUs per node)",
                "make the GPUs before it a multiple of teacher.gpus_per_engine, or use gpus_per_engine 1",
            )


def idle_note(
    c: ClusterConfig, reward: RewardModelConfig | None = None, teacher: TeacherConfig | None = None
) -> str | None:
    """What to say when the layout leaves GPUs of the allocation idle; None when it uses them all."""
    reserved = sum(s.num_gpus for s in frozen_groups(reward, teacher))
    idle = c.idle_gpus(reserved)
    if idle <= 0:
        return None
    actor, rollout = c.split(reserved=reserved)
    if c.heterogeneous:
        parts = [
            f"{group} uses {used} of its component's {have}"
            for group, used, have in (
                ("the actor", actor, c.num_nodes * c.gpus_per_node),
                ("the rollout", rollout, (c.rollout_nodes or 0) * c.rollout_node_gpus),
                ("the reward model", reserved, (c.reward_nodes or 0) * c.reward_node_gpus),
            )
            if used < have
        ]
        return (
            f"{idle} of the {c.total_gpus} GPUs sit idle: {' and '.join(parts)}. To use them, leave "
            "cluster.actor_num_gpus and cluster.rollout_num_gpus unset (each group then takes its whole "
            "component) or raise them (reward_model.num_gpus for the reward model's); or ask for fewer nodes or "
            "GPUs per node for that component"
        )
    used = c.used_gpus(reserved)
    frozen_part = "".join(f" + {s.SECTION.replace('_', ' ')} {s.num_gpus}" for s in frozen_groups(reward, teacher))
    if used <= c.gpus_per_node:
        fewer = f"--nodes 1 --gpus-per-node {used}"
    elif -(-used // c.gpus_per_node) < c.num_nodes:
        fewer = f"--nodes {-(-used // c.gpus_per_node)} --gpus-per-node {c.gpus_per_node}"
    else:  # every node is needed: only a whole-allocation split uses the rest
        fewer = None
    return (
        f"{idle} of the {c.total_gpus} GPUs sit idle: the layout uses {used} (actor {actor} + rollout {rollout}"
        f"{', colocated' if c.colocate else ''}{frozen_part}). To use them, leave cluster.actor_num_gpus and "
        "cluster.rollout_num_gpus unset (the default split takes the whole allocation) or raise them"
        + (f"; or ask for fewer: {fewer}" if fewer else "")
    )


def summarize_layout(layout: Layout, node_names: list[str] | None = None) -> str:
    """The plan in a screenful at any size: one line per run of nodes that look alike (which GPUs
    hold actor ranks, which engines, which are idle), with the rank and engine ranges they hold."""
    num_nodes = len(layout.node_gpus)
    actor_on: list[list[tuple[int, int]]] = [[] for _ in range(num_nodes)]  # (rank, gpu) per node
    engine_on: list[list[tuple[int, int]]] = [[] for _ in range(num_nodes)]  # (engine, gpu) per node
    reward_on: list[list[tuple[int, int]]] = [[] for _ in range(num_nodes)]  # (reward engine, gpu) per node
    teacher_on: list[list[tuple[int, int]]] = [[] for _ in range(num_nodes)]  # (teacher engine, gpu) per node
    for rank, slot in enumerate(layout.actor_slots):
        node, gpu = layout.slot_homes[slot]
        actor_on[node].append((rank, gpu))
    for e, slots in enumerate(layout.engine_slots):
        for slot in slots:
            node, gpu = layout.slot_homes[slot]
            engine_on[node].append((e, gpu))
    for on, group in ((reward_on, layout.reward_slots), (teacher_on, layout.teacher_slots)):
        for e, slots in enumerate(group):
            for slot in slots:
                node, gpu = layout.slot_homes[slot]
                on[node].append((e, gpu))

    def node_shape(n: int) -> tuple:
        used = {g for on in (actor_on, engine_on, reward_on, teacher_on) for _, g in on[n]}
        gpus = layout.node_gpus[n]
        return (
            _span(g for _, g in actor_on[n]), _span(g for _, g in engine_on[n]), gpus - len(used), gpus,
            _span(g for _, g in reward_on[n]), _span(g for _, g in teacher_on[n]),
        )  # fmt: skip

    shapes = [node_shape(n) for n in range(num_nodes)]

    def name(n: int) -> str:
        return node_names[n] if node_names and n < len(node_names) else f"node{n}"

    tps = sorted({len(s) for s in layout.engine_slots})
    mode = _mode(layout)
    lines = [
        f"GPU layout: {layout.num_slots} of {sum(layout.node_gpus)} GPUs on {num_nodes} node(s), {mode}: "
        f"{len(layout.actor_slots)} actor "
        f"rank(s), {len(layout.engine_slots)} engine(s) (tp={'/'.join(map(str, tps))})"
        + (
            f", {len(layout.reward_slots)} reward engine(s) (tp={len(layout.reward_slots[0])}, GPUs of their own)"
            if layout.reward_slots
            else ""
        )
        + (
            f", {len(layout.teacher_slots)} teacher engine(s) (tp={len(layout.teacher_slots[0])}, GPUs of their own)"
            if layout.teacher_slots
            else ""
        )
    ]
    start = 0
    for n in range(1, num_nodes + 1):
        if n < num_nodes and shapes[n] == shapes[start]:
            continue
        nodes = range(start, n)
        actor_gpus, engine_gpus, idle, gpus, reward_gpus, teacher_gpus = shapes[start]
        parts = []
        ranks = [r for k in nodes for r, _ in actor_on[k]]
        if ranks:
            parts.append(f"actor ranks {_span(ranks)} on gpu{actor_gpus}")
        engines = [e for k in nodes for e, _ in engine_on[k]]
        if engines:
            parts.append(f"engines {_span(engines)} on gpu{engine_gpus}")
        rewards = [e for k in nodes for e, _ in reward_on[k]]
        if rewards:
            parts.append(f"reward engines {_span(rewards)} on gpu{reward_gpus}")
        teachers = [e for k in nodes for e, _ in teacher_on[k]]
        if teachers:
            parts.append(f"teacher engines {_span(teachers)} on gpu{teacher_gpus}")
        if idle:
            parts.append(f"{idle} GPU(s) idle" if idle < gpus else "idle")
        where = name(start) if len(nodes) == 1 else f"{name(start)}..{name(n - 1)} ({len(nodes)} nodes)"
        lines.append(f"  {where}: {'; '.join(parts)}")
        start = n
    return "\n".join(lines)


def _span(values) -> str:
    """``[0, 1, 2, 3]`` -> ``"0-3"``, ``[4]`` -> ``"4"``, with gaps ``"0-1,5"``."""
    vs = sorted(set(values))
    if not vs:
        return ""
    runs, lo = [], vs[0]
    for prev, v in zip(vs, [*vs[1:], None]):
        if v != prev + 1:
            runs.append(f"{lo}" if lo == prev else f"{lo}-{prev}")
            lo = v
    return ",".join(runs)


def _mode(layout: Layout) -> str:
    if layout.colocate:
        return "colocated (actor and engines share GPUs)"
    if 2 in layout.slot_groups:
        return "heterogeneous (the actor, the engines and the reward engines on components of their own)"
    return (
        "heterogeneous (the actor and the engines on components of their own)"
        if layout.heterogeneous
        else ("disaggregated")
    )


def describe_layout(layout: Layout, node_names: list[str] | None = None) -> str:
    """The full map, one line per actor rank and per engine (RUN_DIR/layout.txt; the screen gets
    ``summarize_layout``)."""

    def where(slot: int) -> str:
        node, gpu = layout.slot_homes[slot]
        name = node_names[node] if node_names and node < len(node_names) else f"node{node}"
        return f"{name}:gpu{gpu}"

    lines = [f"GPU layout: {layout.num_slots} GPUs, {_mode(layout)}"]
    for rank, slot in enumerate(layout.actor_slots):
        lines.append(f"  actor rank {rank:<3d} -> {where(slot)}")
    for e, slots in enumerate(layout.engine_slots):
        lines.append(f"  engine {e:<3d} (tp={len(slots)}) -> {', '.join(where(s) for s in slots)}")
    for e, slots in enumerate(layout.reward_slots):
        lines.append(f"  reward engine {e:<3d} (tp={len(slots)}) -> {', '.join(where(s) for s in slots)}")
    for e, slots in enumerate(layout.teacher_slots):
        lines.append(f"  teacher engine {e:<3d} (tp={len(slots)}) -> {', '.join(where(s) for s in slots)}")
    return "\n".join(lines)
