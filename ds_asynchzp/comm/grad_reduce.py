"""Per micro-step: reduce each gradient bucket inside the d_g grad shard group.

Replaces Stage 3's bucket reduce-scatter over the whole world. On the training thread, the bucket's gradients
are packed, in one pass per gradient (copy, cast to the communication dtype), into a staging slot laid out as
[d_g, width], in which member i's row holds atoms {i + t*d_g} of every gradient; the zero padding of the last
atom is written in the same pass. Dividing by the data-parallel world before the sum, as stock ZeRO-3 does,
keeps both summing the same values. The gradients are then free to go: the reduction reads only the slot.

The reduce-scatter and the addition of this rank's atoms into the gradient shard run as one job of the
`reduce` thread. Whoever reads the gradient shard first waits for every such job (`drain`).
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from ..accounting import ledger
from ..runtime.process_groups import Group
from ..state.buffer_pool import StagingRing
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
    def __init__(self, grads: GradShards, group: Group, world: int, use_reduce_scatter: bool, runner):
        self.grads = grads
        self.group = group
        self.world = world
        self.use_reduce_scatter = use_reduce_scatter
        self.runner = runner
        # Four buckets in flight let one micro-step's reductions run on into the next forward.
        self.staging = StagingRing(slots=4)
        self.scratch = {}            # receive buffer, used only inside reduce jobs
        self.inflight: List = []     # jobs not yet waited for, in submission order

    def reduce_bucket(self, params: Sequence[torch.nn.Parameter], comm_dtype: torch.dtype):
        """Pack the bucket's gradients (training thread) and submit their reduction into the gradient shard.
        Returns the job; the gradients may be freed at once."""
        buffer, d_g = self.grads.buffer, self.group.size
        rows = buffer.rows
        sizes = [rows * buffer.columns[p.ds_id].atom for p in params]
        width = sum(sizes)
        device = params[0].grad.device
        index, send = self.staging.acquire(d_g * width, comm_dtype, device)
        send = send.view(d_g, width)
        offset = 0
        for param, size in zip(params, sizes):
            # The [d_g, T_g, atom] region seen as [T_g, d_g, atom]: row t, member i <- atom t*d_g + i.
            region = send[:, offset:offset + size].view(d_g, rows, -1).transpose(0, 1)
            pack_transposed(region, param.grad)
            offset += size
        send.div_(self.world)
        targets = [buffer.atoms(p) for p in params]
        self.grads.begin_accumulate(params)

        def job() -> None:
            with ledger.tagged("asynchzp.grad_reduce_scatter"):
                if self.use_reduce_scatter:
                    mine = scratch(self.scratch, "recv", width, comm_dtype, send.device)
                    reduce_scatter(mine, send.view(-1), self.group).wait()
                else:
                    # zero_optimization.reduce_scatter = false: the same sum through an all-reduce, as stock does.
                    all_reduce(send.view(-1), self.group).wait()
                    mine = send[self.group.rank]
            start = 0
            for atoms, size in zip(targets, sizes):
                atoms.add_(mine[start:start + size].view(atoms.shape))
                start += size

        pending = self.runner.submit(job, "gradient reduce-scatter", self.group.name)
        self.staging.hold(index, pending)
        self.inflight.append(pending)
        return pending

    def drain(self) -> None:
        """Wait until every submitted bucket is in the gradient shard."""
        jobs, self.inflight = self.inflight, []
        for job in jobs:
            job.wait()
