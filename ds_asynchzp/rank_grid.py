"""All process groups of the hierarchical layout, built from one rank grid.

Data-parallel ranks are laid out node-major: rank r lives on node r // node_size. For a shard size k the
world is the grid `arange(world).view(world // k, k)`:

* a row is a **shard group** (k consecutive ranks; inside one node when k <= node_size): per micro-step
  collectives run here;
* a column is a **replica group** (ranks with the same position j = r % k in their row, one per row): the
  once-per-optimizer-step collectives that cross nodes run here.

DeepSpeed keeps its own partition over the whole world ("primary": rank q holds slice q of every padded
parameter). Slice j of a k-way shard is the run of primary slices j*m .. j*m + m - 1 (m = world // k). A
replica group gathers (or reduce-scatters) exactly such a run if member g contributes primary slice j*m + g,
which rank r = g*k + j does not own: one point-to-point permutation moves slice `primary_slice_for(r)` to r.
`torch.distributed.new_group` sorts ranks, so that permutation cannot be folded into a group's rank order.

Every rank creates every group, in the same order, including groups it is not a member of: that is what
`new_group` requires of all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from .deepspeed_internals import ds_comm


@dataclass(frozen=True)
class ShardLayout:
    """Where one k-way sharded state lives; pure arithmetic, no process groups."""

    world: int
    shard_size: int

    @property
    def replicas(self) -> int:
        return self.world // self.shard_size

    def all_shard_groups(self) -> List[List[int]]:
        return [list(range(s, s + self.shard_size)) for s in range(0, self.world, self.shard_size)]

    def all_replica_groups(self) -> List[List[int]]:
        return [list(range(j, self.world, self.shard_size)) for j in range(self.shard_size)]

    def primary_slice_for(self, rank: int) -> int:
        """Primary slice that rank r = g*k + j contributes to its replica-group collective: j*m + g."""
        g, j = divmod(rank, self.shard_size)
        return j * self.replicas + g

    def rank_holding_slice_role_of(self, primary_slice: int) -> int:
        """Inverse of `primary_slice_for`: the rank whose replica-group role is that primary slice."""
        j, g = divmod(primary_slice, self.replicas)
        return g * self.shard_size + j


@dataclass
class ProcessGroups:
    """Process groups this rank uses, plus the layouts they came from."""

    rank: int
    world: int
    node_size: int
    param_layout: ShardLayout
    grad_layout: ShardLayout
    # None where the group would hold one rank: callers check the layout size, never `group is None`
    # (None means "the world group" to torch.distributed).
    param_shard: object = None     # per micro-step parameter all-gather (inside a node)
    grad_shard: object = None      # per micro-step gradient reduce-scatter (inside a node)
    param_replica: object = None   # once per step: refresh of the parameter shard (crosses nodes)
    grad_replica: object = None    # once per step: cross-node gradient reduction (crosses nodes)
    permute: object = None         # once per step: point-to-point slice permutations (crosses nodes)


def build_process_groups(world: int, node_size: int, param_shard_size: int, grad_shard_size: int) -> ProcessGroups:
    """Create every group of the layout on every rank, in one fixed order."""
    rank = ds_comm.get_rank()
    if ds_comm.get_world_size() != world:
        raise RuntimeError(f"layout was resolved for {world} ranks but the job has {ds_comm.get_world_size()}")
    groups = ProcessGroups(rank=rank, world=world, node_size=node_size,
                           param_layout=ShardLayout(world, param_shard_size),
                           grad_layout=ShardLayout(world, grad_shard_size))

    created: Dict[Tuple[int, ...], object] = {}

    def new_group_for(all_rank_lists: List[List[int]]):
        # Group creation is collective over the world: every rank walks every list in the same order.
        mine = None
        for ranks in all_rank_lists:
            if len(ranks) == 1:
                continue  # a one-rank group never communicates; callers skip it by its size
            key = tuple(ranks)
            if key not in created:
                created[key] = ds_comm.new_group(ranks)
            if rank in ranks:
                mine = created[key]
        return mine

    groups.param_shard = new_group_for(groups.param_layout.all_shard_groups())
    groups.grad_shard = new_group_for(groups.grad_layout.all_shard_groups())
    groups.param_replica = new_group_for(groups.param_layout.all_replica_groups())
    groups.grad_replica = new_group_for(groups.grad_layout.all_replica_groups())
    # A dedicated world-sized group for the permutations, so they never interleave with DeepSpeed's own
    # traffic on the default group.
    groups.permute = ds_comm.new_group(list(range(world)))
    return groups
