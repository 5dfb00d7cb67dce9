"""The GPU layout is a pure function; placement order is numeric, never by bundle index."""

from rlhpc.cluster.layout import describe_layout, plan_layout
from rlhpc.cluster.placement import sort_key
from rlhpc.config import ClusterConfig


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
    assert lay.rollout_slots == (0, 1, 2, 3)
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
    text = describe_layout(lay, 8, ["a", "b", "c"])
    assert "actor rank 15  -> b:gpu7" in text
    assert "engine 0   (tp=1) -> c:gpu0" in text


def test_four_gpu_nodes_are_not_assumed_eight():
    lay = plan_layout(
        ClusterConfig(num_nodes=2, gpus_per_node=4, actor_num_gpus=2, rollout_num_gpus=6, rollout_gpus_per_engine=2)
    )
    text = describe_layout(lay, 4)
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
