"""Which rank holds which slice of which state: pure arithmetic, no process groups, no DeepSpeed.

Data-parallel ranks are numbered node-major (rank r lives on node r // node_size). Three shard sizes
d_p | d_g | d_o | N split the states:

* DeepSpeed partitions every parameter over a group of d_o consecutive ranks (the **optimizer group**), the
  group being replicated N / d_o times. Each parameter, padded to a multiple of d_o, is cut into d_o equal
  **atoms**; the member with group rank q owns atom q (its `ds_tensor`, fp32 master and Adam moments).
* The **parameter shard** of rank r holds d_o / d_p atoms: {j + t*d_p : t}, with j = r mod d_p. Row t of the
  shard is atom j + t*d_p, so the rank's own atom sits in row (r mod d_o) // d_p.
* The **gradient shard** holds d_o / d_g atoms: {i + t*d_g : t}, i = r mod d_g; own atom in row
  (r mod d_o) // d_g.

This striding is what makes every collective a plain collective over groups in sorted rank order, with no
point-to-point permutation:

* per micro-step, the d_p ranks of a parameter shard group (consecutive ranks) all-gather their shards:
  member j contributes atoms {j + t*d_p}; viewing the gathered [d_p, T_p, atom] block as [T_p, d_p, atom]
  gives the parameter in atom order (a local transpose after the gather);
* per micro-step, the d_g ranks of a gradient shard group reduce-scatter the gradient laid out as
  [d_g, T_g, atom] (the transpose of its natural [T_g, d_g, atom] order), so member i receives its atoms;
* once per step, the T_g = d_o / d_g ranks {h*d_o + k*d_g + i : k} sum row k of their gradient shards into
  member k's own atom (a reduce-scatter, or a pairwise exchange where the backend's reduce-scatter is not
  bandwidth-optimal), then, if d_o < N, the N / d_o replicas of the optimizer group all-reduce that atom;
* once per step, the T_p = d_o / d_p ranks {h*d_o + t*d_p + j : t} all-gather their own (updated) atoms:
  member t's atom is row t of every member's parameter shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List


@dataclass(frozen=True)
class HierarchicalLayout:
    world: int
    node_size: int
    param_shard_size: int      # d_p
    grad_shard_size: int       # d_g
    optimizer_shard_size: int  # d_o

    def __post_init__(self):
        n, g = self.world, self.node_size
        d_p, d_g, d_o = self.param_shard_size, self.grad_shard_size, self.optimizer_shard_size
        if min(n, g, d_p, d_g, d_o) < 1 or n % g or d_g % d_p or d_o % d_g or n % d_o:
            raise ValueError(f"invalid layout: world={n}, node_size={g}, d_p={d_p}, d_g={d_g}, d_o={d_o} "
                             "(need d_p | d_g | d_o | world and node_size | world)")

    # ----------------------------------------------------------------------------------- sizes
    @property
    def param_rows(self) -> int:
        """T_p: atoms per parameter shard (rows of the parameter shard buffer)."""
        return self.optimizer_shard_size // self.param_shard_size

    @property
    def grad_rows(self) -> int:
        """T_g: atoms per gradient shard (rows of the gradient accumulation buffer)."""
        return self.optimizer_shard_size // self.grad_shard_size

    @property
    def optimizer_replicas(self) -> int:
        """R_o: copies of each optimizer group (all-reduced at the boundary when > 1)."""
        return self.world // self.optimizer_shard_size

    # ------------------------------------------------------------------------------ one rank
    def own_atom(self, rank: int) -> int:
        """The atom this rank owns: its rank inside its optimizer group (DeepSpeed's partition index)."""
        return rank % self.optimizer_shard_size

    def param_row_of_own_atom(self, rank: int) -> int:
        return self.own_atom(rank) // self.param_shard_size

    def grad_row_of_own_atom(self, rank: int) -> int:
        return self.own_atom(rank) // self.grad_shard_size

    def param_shard_atoms(self, rank: int) -> List[int]:
        j = rank % self.param_shard_size
        return [j + t * self.param_shard_size for t in range(self.param_rows)]

    def grad_shard_atoms(self, rank: int) -> List[int]:
        i = rank % self.grad_shard_size
        return [i + t * self.grad_shard_size for t in range(self.grad_rows)]

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    # ---------------------------------------------------------------------------------- groups
    # Each returns every group of its kind (lists of data-parallel ranks in ascending order): group creation
    # is collective, so every rank walks all of them in the same order.
    def param_shard_groups(self) -> List[List[int]]:
        return _consecutive(self.world, self.param_shard_size)

    def grad_shard_groups(self) -> List[List[int]]:
        return _consecutive(self.world, self.grad_shard_size)

    def optimizer_groups(self) -> List[List[int]]:
        return _consecutive(self.world, self.optimizer_shard_size)

    def param_refresh_groups(self) -> List[List[int]]:
        return self._strided_inside_optimizer_groups(self.param_shard_size)

    def grad_boundary_groups(self) -> List[List[int]]:
        return self._strided_inside_optimizer_groups(self.grad_shard_size)

    def outer_replica_groups(self) -> List[List[int]]:
        d_o = self.optimizer_shard_size
        return [list(range(q, self.world, d_o)) for q in range(d_o)]

    def _strided_inside_optimizer_groups(self, stride: int) -> List[List[int]]:
        d_o = self.optimizer_shard_size
        return [list(range(h * d_o + j, (h + 1) * d_o, stride))
                for h in range(self.world // d_o) for j in range(stride)]

    def spans_nodes(self, ranks: List[int]) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1


def _consecutive(world: int, size: int) -> List[List[int]]:
    return [list(range(start, start + size)) for start in range(0, world, size)]


def expert_layout(members: int, members_per_node: int, dense: HierarchicalLayout) -> HierarchicalLayout:
    """The layout of AutoEP's routed experts inside one expert-data-parallel group of `members` ranks, with
    `members_per_node` of them on each node (`runtime/placement.py`): parameters and gradients sharded as the
    dense layout shards them, within the node (gcd with the members per node), optimizer states over the group."""
    return HierarchicalLayout(members, members_per_node, math.gcd(dense.param_shard_size, members_per_node),
                              math.gcd(dense.grad_shard_size, members_per_node), members)


def members_per_node(ranks, node_size: int) -> int | None:
    """How many of `ranks` each node they touch holds, or None when that differs between nodes."""
    per_node: dict = {}
    for rank in ranks:
        per_node[rank // node_size] = per_node.get(rank // node_size, 0) + 1
    counts = set(per_node.values())
    return counts.pop() if len(counts) == 1 else None


def expert_members_per_node(world: int, node_size: int, ep_size: int) -> int | None:
    """Ranks of one AutoEP expert-data-parallel group on each node it touches, or None when that count differs
    between nodes or groups (a layout async_hzp cannot build). DeepSpeed's EDP groups are strided: {k, k + ep,
    k + 2 ep, ...} for k < ep. With ep dividing the node size each node holds node_size / ep of them; with ep at
    least the node size, one per node; otherwise the count varies from node to node."""
    counts = {members_per_node(range(first, world, ep_size), node_size) for first in range(ep_size)}
    return counts.pop() if len(counts) == 1 else None
