"""Families of parameters, each with its own hierarchical layout: the dense parameters over the data-parallel
world, and AutoEP's routed experts over their expert-data-parallel group.

Under AutoEP (`"expert_parallel": {"enabled": true}`) DeepSpeed partitions every routed-expert parameter over
its expert-data-parallel (EDP) group, the ranks holding the same experts, and every other parameter over the
data-parallel world. A single layout over the world would mix slices of different experts, so each family gets
its own, built the same way inside its own group:

* dense: the layout the config resolved (`d_p`, `d_g`, `d_o` over the N data-parallel ranks);
* experts: over the E = N / ep ranks of the rank's EDP group, in their node-major order, with G_e of them on
  each node: `d_p = gcd(d_p, G_e)` and `d_g = gcd(d_g, G_e)` (parameters and gradients inside a node, as the
  dense layout keeps them), optimizer states over the whole EDP group (`d_o = E`), as DeepSpeed partitions
  them. The once-per-step gradient exchange and refresh then cross nodes between the replicas of the same
  experts; every micro-step's expert traffic stays inside the node.

A family's gradients are averaged over the data-parallel world, whatever its group, as DeepSpeed does for
experts (each expert's gradient already holds the tokens its expert-parallel group routed to it).

Any parameter partitioned over another group, or of a placement family DeepSpeed did not document, is refused
before Stage 3 partitions anything.

Each family, once the optimizer has built its groups, shards and flows, is held as a `Placement`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..comm.grad_reduce import GradReduce
from ..comm.step_boundary import StepBoundary
from ..errors import AsyncHZPConfigError
from ..layout import HierarchicalLayout, expert_layout, members_per_node
from ..quantization import QuantizationPlan
from ..state.error_feedback import ErrorFeedback
from ..state.grad_shards import GradShards
from ..state.param_shards import ParamShards
from ..state.sharded_buffer import ShardedBuffer
from ..platform.deepspeed_internals import (AUTOEP_EXPERT_FAMILY, REPLICATED_FAMILY, comm_backend, ds_comm,
                                           expert_data_parallel_group, expert_group_name, group_ranks,
                                           placement_family, resolved_partition_group)
from ..platform.process_groups import ProcessGroups

DENSE = "dense"


@dataclass
class Family:
    name: str                          # "dense", or "expert:<AutoEP group name>"
    layout: HierarchicalLayout
    dp_ranks: Tuple[int, ...]          # global ranks of this rank's group of the family, in layout order
    partition_handle: object           # the group DeepSpeed partitions the family's parameters over
    every_group: List[Tuple[int, ...]]  # every group of the family (this rank's among them), in creation order
    param_ids: set = field(default_factory=set)   # id() of the family's parameters

    @property
    def is_expert(self) -> bool:
        return self.name != DENSE

    @property
    def tag(self) -> str:
        """Ledger tag prefix of the family's collectives."""
        return "asynchzp" if not self.is_expert else "asynchzp.expert"

    @property
    def group_prefix(self) -> str:
        return "" if not self.is_expert else "expert."

    def describe(self) -> str:
        l = self.layout
        return (f"{self.name}: d_p={l.param_shard_size}, d_g={l.grad_shard_size}, d_o={l.optimizer_shard_size} "
                f"over {l.world} ranks ({l.world // l.node_size} node(s) x {l.node_size})")


def _expert_layout(name: str, ranks: List[int], dense: HierarchicalLayout) -> HierarchicalLayout:
    per_node = members_per_node(ranks, dense.node_size)
    if per_node is None:
        raise AsyncHZPConfigError(
            "expert_parallel.autoep_size",
            f"puts different numbers of ranks of expert-data-parallel group {name} ({ranks}) on different nodes "
            f"of {dense.node_size} ranks; async_hzp lays experts out node by node and needs the same count on every "
            "node.", "use an autoep_size that divides the node size, or one of at least the node size.")
    return expert_layout(len(ranks), per_node, dense)


def _reject(name: str, problem: str) -> AsyncHZPConfigError:
    return AsyncHZPConfigError(
        "async_hzp", f"parameter {name!r} {problem}.",
        "async_hzp lays out the data-parallel world's parameters and AutoEP's routed experts; leave the ZeRO "
        "partition group of other parameters to DeepSpeed (no custom ds_zero_partition_process_group), or remove "
        "the async_hzp section.")


def families_of(module, dp_handle, dense: HierarchicalLayout) -> List[Family]:
    """Classify the module's parameters (collective: every rank learns every EDP group, to create their groups
    in one order). The dense family comes first; a family without parameters on this rank is still returned."""
    dp_ranks = group_ranks(dp_handle)
    dense_family = Family(DENSE, dense, tuple(dp_ranks), dp_handle, [tuple(dp_ranks)])
    experts: Dict[str, Family] = {}
    for name, param in module.named_parameters():
        family = placement_family(param)
        group = resolved_partition_group(param)
        if family == REPLICATED_FAMILY:
            # In order: a parameter's atoms follow the group rank, so a reordered world would misplace them.
            if group is not None and group is not dp_handle and group_ranks(group) != dp_ranks:
                raise _reject(name, f"is partitioned over ranks {group_ranks(group)}, neither the data-parallel "
                                    f"world {dp_ranks} nor an AutoEP expert group")
            dense_family.param_ids.add(id(param))
        elif family == AUTOEP_EXPERT_FAMILY:
            group_name = expert_group_name(param)
            edp = expert_data_parallel_group(group_name)
            if group is not None and group is not edp and group_ranks(group) != group_ranks(edp):
                raise _reject(name, f"is an AutoEP expert partitioned over ranks {group_ranks(group)}, not its "
                                    f"expert-data-parallel group {group_ranks(edp)}")
            if group_name not in experts:
                ranks = group_ranks(edp)
                experts[group_name] = Family(f"expert:{group_name}", _expert_layout(group_name, ranks, dense),
                                             tuple(ranks), edp, [])
            experts[group_name].param_ids.add(id(param))
        else:
            raise _reject(name, f"has ZeRO placement family {family!r}")
    # Every rank creates every group: learn the other ranks' EDP groups (each rank knows only its own).
    names = sorted(experts)
    gathered = [None] * ds_comm.get_world_size()
    # The backend's own call: through `deepspeed.comm` the comms logger ends the process (with status 0!) on an
    # operation name it has no bandwidth formula for, and `all_gather_object` is one.
    comm_backend().all_gather_object(gathered, {n: experts[n].dp_ranks for n in names})
    for n in names:
        experts[n].every_group = sorted({tuple(r[n]) for r in gathered})
    return [dense_family] + [experts[n] for n in names]


@dataclass
class Placement:
    """One family's layout, groups, shards and flows, as the optimizer builds them. The shards exist from the
    optimizer's construction on; `trainable`, `grads` and `reduce` only where the family has trainable parameters
    on this rank (Stage 3 creates them during its construction); all go at `destroy`."""

    family: Family
    groups: ProcessGroups
    shards: ParamShards
    quantization: QuantizationPlan
    other_groups: List[ProcessGroups] = field(default_factory=list)  # the family's groups this rank is not in
    trainable: Optional[ShardedBuffer] = None
    grads: Optional[GradShards] = None
    reduce: Optional[GradReduce] = None
    boundary: Optional[StepBoundary] = None
    error_feedback: Optional[ErrorFeedback] = None
    repartitioned_from: Dict[int, object] = field(default_factory=dict)

    def owns(self, param) -> bool:
        return id(param) in self.family.param_ids


__all__ = ["DENSE", "Family", "Placement", "families_of"]
