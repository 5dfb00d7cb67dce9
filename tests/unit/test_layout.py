"""The GPU layout is a pure function; placement order is numeric, never by bundle index."""

import pytest

from rlhpc.cluster.layout import describe_layout, plan_layout
from rlhpc.cluster.placement import sort_key
from rlhpc.config import ClusterConfig
from rlhpc.errors import ConfigError


def test_disaggregated_actor_first_then_engines():
    lay = plan_layout(
        ClusterConfig(num_nodes=2, gpus_per_node=4, actor_num_gpus=4, rollout_num_gpus=4, rollout_gpus_per_engine=2)
    )
    assert lay.actor_slots == (0, 1, 2, 3)
    assert lay.engine_slots == ((4, 5), (6, 7))
    assert lay.num_slots == 8 and not lay.colocate


def test_colocate_shares_slots():
    lay = plan_layout(ClusterConfig(gpus_per_node=4, actor_num_gpus=4, rollout_num_gpus=4, colocate=True))
    assert lay.actor_slots == (0, 1, 2, 3)
    assert lay.engine_slots == ((0,), (1,), (2,), (3,))
    assert lay.num_slots == 4


def test_colocate_with_fewer_rollout_gpus():
    lay = plan_layout(
        ClusterConfig(gpus_per_node=8, actor_num_gpus=8, rollout_num_gpus=4, rollout_gpus_per_engine=4, colocate=True)
    )
    assert lay.engine_slots == ((0, 1, 2, 3),)
    assert lay.num_slots == 8


def test_uneven_three_node_layout():
    # 3 nodes x 8: actor takes 16 GPUs (nodes 0-1), 8 single-GPU engines on node 2
    lay = plan_layout(ClusterConfig(num_nodes=3, gpus_per_node=8, actor_num_gpus=16, rollout_num_gpus=8))
    assert lay.actor_slots == tuple(range(16))
    assert lay.engine_slots == tuple((16 + i,) for i in range(8))
    text = describe_layout(lay, ["a", "b", "c"])
    assert "actor rank 15  -> b:gpu7" in text
    assert "engine 0   (tp=1) -> c:gpu0" in text


def test_four_gpu_nodes_are_not_assumed_eight():
    lay = plan_layout(
        ClusterConfig(num_nodes=2, gpus_per_node=4, actor_num_gpus=2, rollout_num_gpus=6, rollout_gpus_per_engine=2)
    )
    text = describe_layout(lay)
    assert "engine 0   (tp=2) -> node0:gpu2, node0:gpu3" in text
    assert "engine 1   (tp=2) -> node1:gpu0, node1:gpu1" in text


def test_bundles_sorted_numerically_by_ip_then_gpu():
    locs = [("10.0.0.10", 0), ("10.0.0.9", 1), ("10.0.0.9", 0), ("10.0.0.10", 10), ("10.0.0.10", 2)]
    assert sorted(locs, key=sort_key) == [
        ("10.0.0.9", 0),
        ("10.0.0.9", 1),
        ("10.0.0.10", 0),
        ("10.0.0.10", 2),
        ("10.0.0.10", 10),
    ]


# ---------------------------------------------------------------- the default split and the summary


def test_the_default_split_uses_the_whole_allocation():
    from rlhpc.preflight import load_config

    assert ClusterConfig().split() == (1, 1)  # the embedded default: 1 rank + 1 engine
    assert ClusterConfig(num_nodes=2, gpus_per_node=4).split() == (4, 4)
    # whole engines: 2 x 3-GPU engines (6 of 8 would be half rounded down), the actor gets the rest
    assert ClusterConfig(num_nodes=1, gpus_per_node=8, rollout_gpus_per_engine=3).split() == (5, 3)
    assert ClusterConfig(gpus_per_node=8, rollout_num_gpus=2).split() == (6, 2)  # one set: the other the rest
    assert ClusterConfig(gpus_per_node=8, actor_num_gpus=3, rollout_gpus_per_engine=2).split() == (3, 4)
    assert ClusterConfig(gpus_per_node=8, colocate=True, rollout_gpus_per_engine=3).split() == (8, 6)
    assert ClusterConfig(num_nodes=1, gpus_per_node=7).split(tp=2) == (4, 3)  # whole TP groups
    # load_config resolves the split once and records the numbers (config.yaml holds them)
    cfg = load_config(None, ["model.tiny={}", "cluster.num_nodes=2", "cluster.gpus_per_node=4"])
    assert (cfg.cluster.actor_num_gpus, cfg.cluster.rollout_num_gpus) == (4, 4) and cfg.cluster.idle_gpus() == 0


def test_a_fixed_split_smaller_than_the_allocation_is_named():
    from rlhpc.cluster.layout import idle_note

    assert idle_note(ClusterConfig(num_nodes=2, gpus_per_node=4)) is None
    note = idle_note(ClusterConfig(num_nodes=2, gpus_per_node=4, actor_num_gpus=1, rollout_num_gpus=1))
    assert note.startswith("6 of the 8 GPUs sit idle") and "--nodes 1 --gpus-per-node 2" in note
    note = idle_note(ClusterConfig(num_nodes=3, gpus_per_node=8, actor_num_gpus=12, rollout_num_gpus=9,
                                   rollout_gpus_per_engine=3))  # fmt: skip
    assert note.startswith("3 of the 24 GPUs") and "ask for fewer" not in note  # every node is needed


def test_the_summary_is_a_screenful_at_any_size():
    from rlhpc.cluster.layout import summarize_layout

    c = ClusterConfig(num_nodes=1024, gpus_per_node=8, rollout_gpus_per_engine=2)
    lay = plan_layout(c)
    text = summarize_layout(lay)
    assert text.splitlines()[1:] == [
        "  node0..node511 (512 nodes): actor ranks 0-4095 on gpu0-7",
        "  node512..node1023 (512 nodes): engines 0-2047 on gpu0-7",
    ]
    assert len(describe_layout(lay).splitlines()) == 1 + 4096 + 2048  # the full map, for RUN_DIR/layout.txt
    mixed = plan_layout(ClusterConfig(num_nodes=4, gpus_per_node=8, actor_num_gpus=12, rollout_num_gpus=6))
    assert summarize_layout(mixed).splitlines()[1:] == [
        "  node0: actor ranks 0-7 on gpu0-7",
        "  node1: actor ranks 8-11 on gpu0-3; engines 0-3 on gpu4-7",
        "  node2: engines 4-5 on gpu0-1; 6 GPU(s) idle",
        "  node3: idle",
    ]


def test_a_heterogeneous_job_puts_each_group_on_its_own_component():
    from rlhpc.cluster.layout import idle_note, summarize_layout

    c = ClusterConfig(num_nodes=1, gpus_per_node=4, rollout_nodes=2, rollout_gpus_per_node=2)
    assert c.split() == (4, 4) and c.total_gpus == 8 and c.node_gpus == (4, 2, 2)
    lay = plan_layout(c)
    assert lay.actor_slots == (0, 1, 2, 3) and lay.engine_slots == ((4,), (5,), (6,), (7,))
    assert lay.slot_groups == (0, 0, 0, 0, 1, 1, 1, 1) and lay.heterogeneous
    assert lay.slot_homes[3:] == ((0, 3), (1, 0), (1, 1), (2, 0), (2, 1))
    assert summarize_layout(lay).splitlines()[1:] == [
        "  node0: actor ranks 0-3 on gpu0-3",
        "  node1..node2 (2 nodes): engines 0-3 on gpu0-1",
    ]
    assert idle_note(c) is None
    # a smaller actor leaves GPUs of its own component idle, never the engines' to take
    small = ClusterConfig(num_nodes=1, gpus_per_node=4, rollout_nodes=2, rollout_gpus_per_node=2, actor_num_gpus=2)
    assert plan_layout(small).engine_slots[0] == (2,) and plan_layout(small).slot_homes[2] == (1, 0)
    assert idle_note(small).startswith("2 of the 8 GPUs sit idle: the actor uses 2 of its component's 4")
    # an engine two rollout nodes wide spans them evenly; one that does not is refused
    assert plan_layout(
        ClusterConfig(rollout_nodes=2, rollout_gpus_per_node=2, rollout_gpus_per_engine=4)
    ).engine_slots == ((2, 3, 4, 5),)
    with pytest.raises(ConfigError, match="spans nodes unevenly"):
        ClusterConfig(rollout_nodes=2, rollout_gpus_per_node=2, rollout_gpus_per_engine=3)
