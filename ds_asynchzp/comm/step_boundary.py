"""Once per optimizer step, the only traffic that crosses nodes: the gradient sum and the parameter refresh.

Both walk their buffer in column chunks of at most one bucket, through reusable scratch, so the transient
memory is one bucket, not one shard.

* Gradients: the T_g = d_o / d_g ranks {h*d_o + k*d_g + i : k} each hold row k' of the others' atoms; member
  k receives row k from every member and sums them in fp32 into its own atom. Each rank sends only the sums
  the others own, once, in the communication dtype. gloo's reduce-scatter is an all-reduce underneath (twice
  the bytes), so on gloo this is a pairwise exchange (all-to-all); elsewhere the backend's reduce-scatter.
  With d_o < N the N / d_o optimizer replicas then all-reduce the own atoms.
* Parameters: after the optimizer step each rank's own atoms are updated; the T_p = d_o / d_p ranks
  {h*d_o + t*d_p + j : t} all-gather them, which rebuilds row t of every member's parameter shard.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..accounting import ledger
from ..runtime.process_groups import ProcessGroups
from ..state.grad_shards import GradShards, Window
from ..state.sharded_buffer import ShardedBuffer
from .collectives import all_gather, all_reduce, all_to_all, backend_reduce_scatter_is_optimal, reduce_scatter, scratch


class StepBoundary:
    def __init__(self, groups: ProcessGroups, bucket_elements: int):
        self.groups = groups
        self.bucket_elements = max(1, int(bucket_elements))
        self.pairwise = not backend_reduce_scatter_is_optimal(groups.grad_boundary)
        self.scratch = {}

    # ------------------------------------------------------------------------------- gradients
    @torch.no_grad()
    def reduce_grads(self, grads: GradShards, comm_dtype: torch.dtype) -> None:
        buffer = grads.buffer
        boundary, outer = self.groups.grad_boundary, self.groups.outer_replica
        rows, device = buffer.rows, buffer.data.device
        for start, end in buffer.column_chunks(self.bucket_elements):
            cols = end - start
            own = buffer.data[buffer.own_row, start:end]
            if rows > 1:
                send = scratch(self.scratch, "grad_send", rows * cols, comm_dtype, device).view(rows, cols)
                send.copy_(buffer.data[:, start:end])
                with ledger.tagged("asynchzp.boundary_grad"):
                    if self.pairwise:
                        recv = scratch(self.scratch, "grad_recv", rows * cols, comm_dtype, device).view(rows, cols)
                        all_to_all(recv.view(-1), send.view(-1), boundary).wait()
                        total = scratch(self.scratch, "grad_sum", cols, torch.float32, device)
                        total.copy_(recv[0])
                        for row in recv[1:]:
                            total.add_(row)
                    else:
                        total = scratch(self.scratch, "grad_sum", cols, comm_dtype, device)
                        reduce_scatter(total, send.view(-1), boundary).wait()
                own.copy_(total)
            if outer.size > 1:
                with ledger.tagged("asynchzp.boundary_allreduce"):
                    if own.dtype == comm_dtype:
                        all_reduce(own, outer).wait()
                    else:
                        staged = scratch(self.scratch, "grad_outer", cols, comm_dtype, device)
                        staged.copy_(own)
                        all_reduce(staged, outer).wait()
                        own.copy_(staged)
        grads.window = Window.REDUCED

    # ------------------------------------------------------------------------------ parameters
    @torch.no_grad()
    def refresh_params(self, buffers: Iterable[ShardedBuffer]) -> None:
        group = self.groups.param_refresh
        if group.size == 1:
            return
        for buffer in buffers:
            rows = buffer.rows
            for start, end in buffer.column_chunks(self.bucket_elements):
                cols = end - start
                recv = scratch(self.scratch, "param_recv", rows * cols, buffer.data.dtype, buffer.data.device)
                with ledger.tagged("asynchzp.param_refresh"):
                    all_gather(recv, buffer.data[buffer.own_row, start:end], group).wait()
                buffer.data[:, start:end].copy_(recv.view(rows, cols))
