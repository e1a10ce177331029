"""Every process group of the hierarchical layout, built from one rank grid (`ds_asynchzp.layout`).

Each group travels as a `Group` record (handle, size, this rank's index, global ranks), so no caller ever
passes `None` and gets the world group by accident: a one-rank group has no handle and never communicates. The
exception is the optimizer group, which is DeepSpeed's partition group: DeepSpeed reads a missing group as the
world, so with d_o = 1 it gets a one-rank group of its own.

Groups are built over the data-parallel group DeepSpeed hands the ZeRO optimizer (its ranks, not the global
world). Every rank creates every group, in one fixed order, including groups it is not a member of: that is
what `new_group` requires.

Each group has one issuing thread (`OWNER`), and groups of different owners never share a communicator, even
when their ranks coincide (d_p = d_g makes the gather and reduce groups the same ranks): two threads issuing on
one communicator interleave their collectives in a different order on each rank, which aborts gloo and hangs
NCCL. The optimizer group is DeepSpeed's, used only by the training thread.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch.distributed

from ..layout import HierarchicalLayout
from .deepspeed_internals import ds_comm


@dataclass(frozen=True)
class Group:
    name: str
    ranks: Tuple[int, ...]    # global ranks, ascending
    handle: object = None     # None exactly when size == 1, except for the optimizer group
    rank: int = 0             # this rank's index in `ranks`
    inter_node: bool = False

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class ProcessGroups:
    layout: HierarchicalLayout
    dp_rank: int                              # this rank's index in the data-parallel group
    param_shard: Group = None                 # per micro-step parameter all-gather (d_p ranks)
    grad_shard: Group = None                  # per micro-step gradient reduce-scatter (d_g ranks)
    optimizer: Group = None                   # DeepSpeed's partition group (d_o ranks)
    param_refresh: Group = None               # once per step: all-gather of updated atoms (d_o / d_p ranks)
    grad_boundary: Group = None               # once per step: gradient sum into the owner (d_o / d_g ranks)
    outer_replica: Group = None               # once per step, d_o < N: all-reduce over optimizer replicas
    bucket_check: Group = None                # the grad shard's ranks on a host (gloo) group: per-bucket metadata
    created: List[object] = field(default_factory=list)     # the handles this record created, to destroy
    member: bool = True                       # whether this rank belongs to the family these groups serve

    def destroy(self) -> None:
        for handle in self.created:
            try:
                ds_comm.destroy_process_group(handle)
            except Exception:  # noqa: BLE001 - best effort at teardown; the backend may already be gone
                pass
        self.created.clear()


# group -> the thread that issues every collective on it (see ds_asynchzp.scheduler.context)
OWNER = {"param_shard": "gather", "grad_shard": "reduce", "optimizer": "training", "param_refresh": "boundary",
         "grad_boundary": "boundary", "outer_replica": "boundary", "bucket_check": "reduce"}


def build_process_groups(layout: HierarchicalLayout, dp_global_ranks: List[int], dp_handle,
                         family: str = "", timeout_s: Optional[float] = None,
                         creation_order: Optional[List[Tuple[object, Tuple[int, ...], str]]] = None) -> ProcessGroups:
    """Create every group of `layout`; `dp_global_ranks[i]` is the global rank of data-parallel rank i of the
    family (its layout's world). A rank outside `dp_global_ranks` still creates every group, since group
    creation is collective over the whole world; its record then has `member` false and no group of its own.
    `family` prefixes the groups' names ("expert." for AutoEP's experts).

    Each group gets `timeout_s` as its backend timeout (`comm_timeout_s`): on NCCL a host wait only times the
    enqueue, so a peer that stops while alive is found by the backend's watchdog at the group's timeout, not at
    the default 10 or 30 minutes. (handle, ranks, name) of each group made is appended to `creation_order`,
    which is the same list on every rank, for `warm_up_groups`."""
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    me = ds_comm.get_rank()
    if len(dp_global_ranks) != layout.world:
        raise RuntimeError(f"async_hzp layout was resolved for a data-parallel world of {layout.world} ranks, but "
                           f"DeepSpeed's data-parallel group has {len(dp_global_ranks)}")
    member = me in dp_global_ranks
    groups = ProcessGroups(layout=layout, dp_rank=dp_global_ranks.index(me) if member else -1)
    cache: Dict[Tuple[str, Tuple[int, ...]], object] = {}

    def make(name: str, all_groups: List[List[int]], reuse: Optional[object] = None) -> Group:
        mine = None
        for dp_ranks in all_groups:
            ranks = tuple(dp_global_ranks[r] for r in dp_ranks)
            handle = None
            # DeepSpeed partitions over the optimizer group and takes None for the world: it always needs one.
            if len(ranks) > 1 or name == "optimizer":
                if name == "optimizer" and len(ranks) == layout.world:
                    # DeepSpeed's own partition group: created by DeepSpeed on every rank already (`reuse` is None
                    # on ranks outside it, which then have nothing to create either).
                    handle = reuse
                elif (OWNER[name], ranks) in cache:
                    handle = cache[OWNER[name], ranks]
                else:
                    # torch's own call (DeepSpeed's new_group takes no timeout); the same group otherwise.
                    handle = cache[OWNER[name], ranks] = torch.distributed.new_group(list(ranks), timeout=timeout)
                    groups.created.append(handle)
                    if creation_order is not None:
                        creation_order.append((handle, ranks, family + name))
            if me in ranks:
                mine = Group(family + name, ranks, handle, ranks.index(me), layout.spans_nodes(list(dp_ranks)))
        return mine

    groups.param_shard = make("param_shard", layout.param_shard_groups())
    groups.grad_shard = make("grad_shard", layout.grad_shard_groups())
    groups.optimizer = make("optimizer", layout.optimizer_groups(), reuse=dp_handle)
    groups.param_refresh = make("param_refresh", layout.param_refresh_groups())
    groups.grad_boundary = make("grad_boundary", layout.grad_boundary_groups())
    groups.outer_replica = make("outer_replica", layout.outer_replica_groups())
    groups.bucket_check = _host_group(groups.grad_shard, layout.grad_shard_groups(), dp_global_ranks, family, timeout,
                                      groups.created)
    groups.member = member
    return groups


def _host_group(device_group: Optional[Group], all_groups: List[List[int]], dp_global_ranks: List[int], family: str,
                timeout, created: List[object]) -> Optional[Group]:
    """The ranks of `device_group` on a gloo group, for metadata the host must read: on a device backend, reading
    a collective's result on the host would synchronise the device (and, under the one issue order, hold every
    later job). Where the default backend is gloo already, it is the device group itself."""
    if torch.distributed.get_backend() == "gloo":
        return device_group
    mine = None
    me = ds_comm.get_rank()
    for dp_ranks in all_groups:
        ranks = tuple(dp_global_ranks[r] for r in dp_ranks)
        handle = None
        if len(ranks) > 1:
            handle = torch.distributed.new_group(list(ranks), timeout=timeout, backend="gloo")
            created.append(handle)
        if me in ranks:
            mine = Group(family + "bucket_check", ranks, handle, ranks.index(me),
                         device_group.inter_node if device_group is not None else False)
    return mine
