"""Per micro-step: reduce each gradient bucket inside the d_g grad shard group.

Replaces Stage 3's bucket reduce-scatter over the whole world. The bucket's gradients are packed, in one pass
per gradient (copy, cast to the communication dtype), into a reusable [d_g, width] send buffer in which member
i's row holds atoms {i + t*d_g} of every gradient; the zero padding of the last atom is written in the same
pass, without a padded temporary. Dividing by the data-parallel world before the sum, as stock ZeRO-3 does,
keeps both summing the same values. Member i receives its atoms summed over the group; the boundary later
sums them over the replicas.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from ..accounting import ledger
from ..runtime.process_groups import Group
from ..state.grad_shards import GradShards
from .collectives import all_reduce, reduce_scatter, scratch


def pack_transposed(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[t, i, :] = padded(src)[(t*d + i)*atom : ...] for dst of shape [T, d, atom] (any strides), with the
    elements past src's end zeroed: the gradient in atom order, without materialising the padded copy."""
    rows, d, atom = dst.shape
    src = src.reshape(-1)
    n = src.numel()
    block = d * atom
    full_rows = min(rows, n // block)
    if full_rows:
        dst[:full_rows].copy_(src[:full_rows * block].view(full_rows, d, atom))
    if full_rows < rows:
        rest = src[full_rows * block:]
        m = rest.numel()
        row = dst[full_rows]
        whole = m // atom
        if whole:
            row[:whole].copy_(rest[:whole * atom].view(whole, atom))
        if whole < d:
            tail = m - whole * atom
            if tail:
                row[whole, :tail].copy_(rest[whole * atom:])
            row[whole, tail:].zero_()
            row[whole + 1:].zero_()
        dst[full_rows + 1:].zero_()


class GradReduce:
    def __init__(self, grads: GradShards, group: Group, world: int, use_reduce_scatter: bool):
        self.grads = grads
        self.group = group
        self.world = world
        self.use_reduce_scatter = use_reduce_scatter
        self.scratch = {}

    def reduce_bucket(self, params: Sequence[torch.nn.Parameter], comm_dtype: torch.dtype) -> List[torch.Tensor]:
        """Sum the bucket's gradients over the grad shard group; return, per parameter, this rank's atoms
        ([T_g * atom] elements, row-major), views into a scratch buffer valid until the next bucket."""
        rows, d_g = self.grads.buffer.rows, self.group.size
        sizes = [rows * self.grads.buffer.columns[p.ds_id].atom for p in params]
        width = sum(sizes)
        device = params[0].grad.device
        send = scratch(self.scratch, "send", d_g * width, comm_dtype, device).view(d_g, width)
        offset = 0
        for param, size in zip(params, sizes):
            # The [d_g, T_g, atom] region seen as [T_g, d_g, atom]: row t, member i <- atom t*d_g + i.
            region = send[:, offset:offset + size].view(d_g, rows, -1).transpose(0, 1)
            pack_transposed(region, param.grad)
            offset += size
        send.div_(self.world)
        with ledger.tagged("asynchzp.grad_reduce_scatter"):
            if self.use_reduce_scatter:
                mine = scratch(self.scratch, "recv", width, comm_dtype, device)
                reduce_scatter(mine, send.view(-1), self.group).wait()
            else:
                # zero_optimization.reduce_scatter = false: the same sum through an all-reduce, as stock does.
                all_reduce(send.view(-1), self.group).wait()
                mine = send[self.group.rank]
        out, offset = [], 0
        for size in sizes:
            out.append(mine[offset:offset + size])
            offset += size
        return out
