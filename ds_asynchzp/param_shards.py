"""The d_p-way parameter shard: each rank's intra-node working copy, and the gathers that read it.

DeepSpeed keeps its own 1/world partition of every parameter (`ds_tensor`, the "primary"); the optimizer
updates it. This module owns a second partition over the param shard group (d_p ranks, inside a node): rank
r = g*d_p + j holds slice j of the padded parameter. Per micro-step, the parameter coordinator's gathers read
only these shards, so forward and backward all-gathers never leave the node.

The shard is refreshed from the primary once per optimizer step (`refresh`): one point-to-point permutation
and one all-gather over the replica group, i.e. 1/d_p of the model crosses nodes per step instead of 2x the
model per micro-step. Unlike stock hpZ, the shard is never dropped, so the first forward after a step does
not fall back to a world all-gather.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from . import ledger
from .collectives import all_gather_flat, permute
from .deepspeed_internals import install_gather, mark_available, mark_inflight, primary_partition, wrap_partition
from .rank_grid import ProcessGroups

SHARD_ATTR = "hzp_param_shard"


class _CompletedGather:
    """Handle for the parameter coordinator: data is already here; `wait` publishes it.

    The coordinator asserts a parameter is INFLIGHT right after issuing the gather and expects it
    AVAILABLE only after `wait`, so the hand-over happens in `wait`.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], full_tensors: List[torch.Tensor]):
        self.params = list(params)
        self.full_tensors = full_tensors
        self.complete = False

    def wait(self, handle_dependency: bool = True) -> None:
        if self.complete:
            return
        for param, full in zip(self.params, self.full_tensors):
            mark_available(param, full)
        self.complete = True


class ParamShards:
    def __init__(self, params: Sequence[torch.nn.Parameter], groups: ProcessGroups):
        self.groups = groups
        self.layout = groups.param_layout
        self.params = sorted(params, key=lambda p: p.ds_id)
        k, m = self.layout.shard_size, self.layout.replicas
        self.index_in_shard_group = groups.rank % k
        for param in self.params:
            primary = primary_partition(param)
            setattr(param, SHARD_ATTR, torch.empty(m * primary.numel(), dtype=primary.dtype, device=primary.device))
            install_gather(param, self.gather)
            wrap_partition(param, self.rebuild_from_full)
        self.refresh(self.params)

    # ----------------------------------------------------------------------------------- once per step
    def refresh(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Rebuild the shards of `params` from their (updated) primary partitions."""
        params = sorted(params, key=lambda p: p.ds_id)
        if not params:
            return
        layout, rank = self.layout, self.groups.rank
        sizes = [primary_partition(p).numel() for p in params]
        flat_primary = torch.cat([primary_partition(p).reshape(-1) for p in params])
        with ledger.tagged("asynchzp.param_refresh"):
            # This rank's role in its replica group is primary slice `primary_slice_for(rank)`.
            role = permute(flat_primary,
                           send_to=layout.rank_holding_slice_role_of(rank),
                           recv_from=layout.primary_slice_for(rank),
                           group=self.groups.permute)
            gathered = all_gather_flat(role, self.groups.param_replica, layout.replicas)
        rows = gathered.view(layout.replicas, -1)
        offset = 0
        for param, size in zip(params, sizes):
            getattr(param, SHARD_ATTR).copy_(rows[:, offset:offset + size].reshape(-1))
            offset += size

    def rebuild_from_full(self, param: torch.nn.Parameter, full: torch.Tensor) -> None:
        """A caller changed the full parameter (GatheredParameters with a modifier rank): slice it locally."""
        shard = getattr(param, SHARD_ATTR, None)
        if shard is None:
            return
        flat = full.detach().reshape(-1)
        start = self.index_in_shard_group * shard.numel()
        count = max(0, min(flat.numel() - start, shard.numel()))
        with torch.no_grad():
            shard.zero_()
            shard[:count].copy_(flat[start:start + count])

    # ------------------------------------------------------------------------------- per micro-step
    def _gather_full(self, params: List[torch.nn.Parameter]) -> List[torch.Tensor]:
        k = self.layout.shard_size
        shards = [getattr(p, SHARD_ATTR) for p in params]
        with ledger.tagged("asynchzp.param_gather"):
            gathered = all_gather_flat(torch.cat(shards) if len(shards) > 1 else shards[0],
                                       self.groups.param_shard, k)
        rows = gathered.view(k, -1)
        full_tensors, offset = [], 0
        for param, shard in zip(params, shards):
            full = rows[:, offset:offset + shard.numel()].reshape(-1)[:param.ds_numel]
            full_tensors.append(full.view(param.ds_shape))
            offset += shard.numel()
        return full_tensors

    def gather(self, params, safe_mode: bool = False, quantize: bool = False) -> _CompletedGather:
        """Drop-in for DeepSpeed's per-parameter `all_gather_coalesced`, reading the intra-node shards."""
        params = sorted(params, key=lambda p: p.ds_id)
        mark_inflight(params)
        return _CompletedGather(params, self._gather_full(params) if params else [])

    def regather_in_place(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Refresh parameters that stay gathered (ZeRO-3 persistent parameters) after a step."""
        params = sorted(params, key=lambda p: p.ds_id)
        if params:
            for param, full in zip(params, self._gather_full(params)):
                param.data = full

    def shard_bytes(self) -> int:
        return sum(getattr(p, SHARD_ATTR).numel() * getattr(p, SHARD_ATTR).element_size() for p in self.params)


