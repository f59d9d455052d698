"""Which ranks form a node.

Hierarchical algorithms treat ranks on the same node (fast links) differently from ranks on other nodes (slow
links). The grouping is computed once, here, from the world size and the number of ranks per node, either the real
one (Lightning's cluster environment: ``num_nodes``, ``devices``) or a *virtual* one that lets a single machine
exercise the hierarchy (4 local processes as 2 virtual nodes of 2). Ranks are assumed to be laid out node-major,
as torchrun, SLURM and Lightning's launchers do: ``global_rank = node_rank * node_size + local_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Node-major grouping of ``world_size`` ranks into nodes of ``node_size`` ranks.

    Args:
        world_size: total number of ranks.
        node_size: ranks per node (real or virtual); must divide ``world_size``.

    Example::

        topo = Topology(world_size=4, node_size=2)
        assert topo.node_ranks(1) == [2, 3]
        assert topo.cross_node_ranks(local_rank=0) == [0, 2]
    """

    world_size: int
    node_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.node_size < 1:
            raise ValueError(f"node_size must be >= 1, got {self.node_size}")
        if self.world_size % self.node_size:
            divisors = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
            raise ValueError(
                f"node_size={self.node_size} does not divide the world size {self.world_size}; "
                f"HINT: choose a node_size among {divisors}"
            )

    @classmethod
    def from_num_nodes(cls, world_size: int, num_nodes: int) -> Topology:
        """The real topology from Lightning's ``num_nodes`` (each node runs ``world_size // num_nodes`` ranks)."""
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if world_size % num_nodes:
            raise ValueError(f"world size {world_size} is not a multiple of num_nodes={num_nodes}")
        return cls(world_size=world_size, node_size=world_size // num_nodes)

    @classmethod
    def from_cluster(
        cls, world_size: int, num_nodes: int, node_size: int | None = None, virtual_nodes: int | None = None
    ) -> Topology:
        """The strategies' topology: the virtual ``node_size`` when given; else each real node's ranks split into
        ``virtual_nodes`` virtual nodes when given; else the real nodes of the cluster."""
        if node_size is not None and virtual_nodes is not None:
            raise ValueError(f"give node_size ({node_size}) or virtual_nodes ({virtual_nodes}), not both")
        if node_size is not None:
            return cls(world_size=world_size, node_size=node_size)
        real = cls.from_num_nodes(world_size, num_nodes)
        if virtual_nodes is None:
            return real
        if virtual_nodes < 1 or real.node_size % virtual_nodes:
            splits = [d for d in range(1, real.node_size + 1) if real.node_size % d == 0]
            raise ValueError(
                f"virtual_nodes={virtual_nodes} cannot split a node of {real.node_size} rank(s) evenly; HINT: choose "
                f"virtual_nodes among {splits}, or set node_size"
            )
        return cls(world_size=world_size, node_size=real.node_size // virtual_nodes)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.node_size

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.node_size

    def local_rank_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.node_size

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks on ``node``."""
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node must be in [0, {self.num_nodes}), got {node}")
        return list(range(node * self.node_size, (node + 1) * self.node_size))

    def cross_node_ranks(self, local_rank: int) -> list[int]:
        """Global ranks that share ``local_rank`` across all nodes (one inter-node group per local rank)."""
        if not 0 <= local_rank < self.node_size:
            raise ValueError(f"local_rank must be in [0, {self.node_size}), got {local_rank}")
        return [node * self.node_size + local_rank for node in range(self.num_nodes)]

    def all_nodes(self) -> list[list[int]]:
        """Every node's ranks: the enumeration ``torch.distributed.new_subgroups_by_enumeration`` takes."""
        return [self.node_ranks(n) for n in range(self.num_nodes)]

    def all_cross_node(self) -> list[list[int]]:
        """For every local rank, the ranks holding it on each node (the inter-node groups)."""
        return [self.cross_node_ranks(i) for i in range(self.node_size)]

    def spans_nodes(self, ranks: list[int] | None = None) -> bool:
        """Whether a group of ``ranks`` (default: the whole world) crosses a node boundary."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        return len({self.node_of(r) for r in ranks}) > 1

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
