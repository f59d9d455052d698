from __future__ import annotations

import pytest

from lightning_syncasync.algorithms.topology import Topology


def test_virtual_nodes_of_two():
    t = Topology(world_size=4, node_size=2)
    assert t.num_nodes == 2
    assert [t.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [t.local_rank_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert t.node_ranks(1) == [2, 3]
    assert t.cross_node_ranks(1) == [1, 3]
    assert t.spans_nodes() and not t.spans_nodes([2, 3]) and t.spans_nodes([1, 2])


def test_from_cluster_and_enumerations():
    assert Topology.from_cluster(world_size=4, num_nodes=1) == Topology(4, 4)
    virtual = Topology.from_cluster(world_size=4, num_nodes=1, node_size=2)
    assert virtual.all_nodes() == [[0, 1], [2, 3]] and virtual.all_cross_node() == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="node_size=3"):
        Topology.from_cluster(world_size=4, num_nodes=1, node_size=3)


def test_from_num_nodes():
    t = Topology.from_num_nodes(world_size=8, num_nodes=2)
    assert t.node_size == 4 and t.node_ranks(0) == [0, 1, 2, 3]
    assert not Topology.from_num_nodes(world_size=2, num_nodes=1).spans_nodes()


def test_node_size_must_divide_world_size_and_error_names_the_fix():
    with pytest.raises(ValueError, match=r"node_size=3 does not divide the world size 4.*\[1, 2, 4\]"):
        Topology(world_size=4, node_size=3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"world_size": 0, "node_size": 1}, "world_size"), ({"world_size": 2, "node_size": 0}, "node_size")],
)
def test_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_bad_queries():
    t = Topology(world_size=4, node_size=2)
    with pytest.raises(ValueError, match="rank"):
        t.node_of(4)
    with pytest.raises(ValueError, match="node"):
        t.node_ranks(2)
    with pytest.raises(ValueError, match="local_rank"):
        t.cross_node_ranks(2)
    with pytest.raises(ValueError, match="num_nodes"):
        Topology.from_num_nodes(world_size=4, num_nodes=3)


def test_virtual_nodes_split_each_real_node():
    assert Topology.from_cluster(world_size=4, num_nodes=1, virtual_nodes=2) == Topology(world_size=4, node_size=2)
    # 2 machines of 4 ranks, each split in 2: 4 nodes of 2, node-major as the launchers lay ranks out.
    assert Topology.from_cluster(world_size=8, num_nodes=2, virtual_nodes=2).all_nodes() == [
        [0, 1], [2, 3], [4, 5], [6, 7]
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"virtual_nodes=3 cannot split a node of 4 rank\(s\).*\[1, 2, 4\]"):
        Topology.from_cluster(world_size=4, num_nodes=1, virtual_nodes=3)
    with pytest.raises(ValueError, match="not both"):
        Topology.from_cluster(world_size=4, num_nodes=1, node_size=2, virtual_nodes=2)
