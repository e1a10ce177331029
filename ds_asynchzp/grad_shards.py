"""The d_g-way gradient accumulation shard, and the one cross-node reduction per optimizer step.

Stock ZeRO-3 reduce-scatters every gradient bucket over the whole world on every micro-step. Here each
bucket is reduce-scattered only inside the grad shard group (d_g ranks, inside a node) and added to a
persistent fp32 buffer holding this rank's 1/d_g slice, summed over its shard group. At the accumulation
boundary, once per optimizer step, the buffer is reduce-scattered over the replica group (one rank per node)
and permuted into DeepSpeed's 1/world layout, where the stock optimizer step (loss scaling, clipping,
AdamW) picks it up unchanged.

Buffer layout: `accum[t, offset_p : offset_p + ps_p]` holds, for parameter p with primary partition size
ps_p, primary slice j*m + t of this rank's slice j (m = world // d_g). The row-major flat buffer is then
exactly the input a replica-group reduce-scatter needs: member t receives row t.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch

from . import ledger
from .collectives import permute, reduce_scatter_flat
from .deepspeed_internals import primary_partition
from .rank_grid import ProcessGroups


class GradShards:
    def __init__(self, params: Sequence[torch.nn.Parameter], groups: ProcessGroups, world_size: int):
        self.groups = groups
        self.layout = groups.grad_layout
        self.world_size = world_size
        self.params = sorted(params, key=lambda p: p.ds_id)
        self.partition_size: Dict[int, int] = {}
        self.offset: Dict[int, int] = {}
        total = 0
        for param in self.params:
            self.offset[param.ds_id] = total
            self.partition_size[param.ds_id] = primary_partition(param).numel()
            total += self.partition_size[param.ds_id]
        device = primary_partition(self.params[0]).device if self.params else torch.device("cpu")
        # fp32 accumulation: micro-step partial sums are added here A times before the cross-node reduction.
        self.accum = torch.zeros(self.layout.replicas, total, dtype=torch.float32, device=device)
        self.touched: set = set()

    # ------------------------------------------------------------------------------- per micro-step
    def reduce_scatter_bucket(self, params: List[torch.nn.Parameter], grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """Average `grads` (full, unpadded) over the world and keep this rank's 1/d_g slice of each.

        Each gradient is padded to world * ps (DeepSpeed's padded size), so a 1/d_g slice is a whole run of
        primary slices, and the chunks are interleaved so member j of the group receives slice j of every
        gradient from one reduce-scatter.
        """
        k, m = self.layout.shard_size, self.layout.replicas
        chunks = []
        for param, grad in zip(params, grads):
            ps = self.partition_size[param.ds_id]
            padded = torch.zeros(self.world_size * ps, dtype=grad.dtype, device=grad.device)
            padded[:grad.numel()].copy_(grad.reshape(-1))
            chunks.append(padded.view(k, m * ps))
        interleaved = torch.cat(chunks, dim=1) if len(chunks) > 1 else chunks[0]
        # Divide before summing, as stock ZeRO-3 does, so both sum the same (pre-divided) values.
        interleaved = interleaved.contiguous().div_(self.world_size)
        with ledger.tagged("asynchzp.grad_reduce_scatter"):
            mine = reduce_scatter_flat(interleaved.view(-1), self.groups.grad_shard, k)
        slices, offset = [], 0
        for param in params:
            size = m * self.partition_size[param.ds_id]
            slices.append(mine[offset:offset + size])
            offset += size
        return slices

    def accumulate(self, params: List[torch.nn.Parameter], slices: List[torch.Tensor]) -> None:
        m = self.layout.replicas
        for param, grad_slice in zip(params, slices):
            ps, offset = self.partition_size[param.ds_id], self.offset[param.ds_id]
            self.accum[:, offset:offset + ps].add_(grad_slice.view(m, ps).to(torch.float32))
            self.touched.add(param.ds_id)

    # ------------------------------------------------------------------------ once per optimizer step
    def reduce_at_boundary(self, write: Callable[[torch.nn.Parameter, torch.Tensor], None]) -> None:
        """Finish the reduction across nodes and hand each touched parameter its 1/world partition."""
        layout, rank = self.layout, self.groups.rank
        with ledger.tagged("asynchzp.boundary_grad_reduce"):
            role = reduce_scatter_flat(self.accum.view(-1), self.groups.grad_replica, layout.replicas)
            # `role` is primary slice `primary_slice_for(rank)`; send it to its owner.
            mine = permute(role,
                           send_to=layout.primary_slice_for(rank),
                           recv_from=layout.rank_holding_slice_role_of(rank),
                           group=self.groups.permute)
        for param in self.params:
            if param.ds_id in self.touched:
                offset = self.offset[param.ds_id]
                write(param, mine[offset:offset + self.partition_size[param.ds_id]])
        self.accum.zero_()
        self.touched.clear()

    def buffer_bytes(self) -> int:
        return self.accum.numel() * self.accum.element_size()
