"""Per micro-step: reduce each gradient bucket inside the d_g grad shard group.

Replaces Stage 3's bucket reduce-scatter over the whole world. On the training thread, the bucket's gradients
are packed into a staging slot laid out as [d_g, width], in which member i's row holds atoms {i + t*d_g} of
every gradient, zero-padded past each gradient's end: one pass of the `bucket_add` op over all of them, which
also casts to the communication dtype and divides by the data-parallel world (as stock ZeRO-3 divides before
the sum, so both sum the same values; under Ulysses SP stock's all-reduce path divides by world / sp, and so does
this one). The gradients are then free to go: the reduction reads only the slot.

The reduction and the addition of this rank's atoms into the gradient shard run as one job of the `reduce`
thread: a reduce-scatter (or, with `reduce_scatter: false`, an all-reduce, as stock), or with quantized
gradients a quantized pairwise exchange summed in fp32 (`comm.quantized`). Whoever reads the gradient shard
first waits for every such job (`drain`).

Ordering on the device: the pack runs on the stream current in DeepSpeed's hook (its reduce-and-partition side
stream, with `overlap_comm`), so the job's stream waits on an event recorded there after the pack, and on the
gradient shard's host events (the zeroing after a step). The gradients autograd made are another matter: they
belong to the caching allocator of the stream that made them, and the optimizer keeps each alive until the pack
has read it (`platform.streams.keep_alive`) before it drops it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from .. import ops
from ..platform import ledger
from ..errors import GradientMismatchError
from ..platform import streams
from ..platform.process_groups import Group
from ..quantization import QuantFormat
from ..state.buffer_pool import StagingRing
from ..state.grad_shards import GradShards
from ..state.scratch import Scratch
from . import quantized
from .collectives import all_gather, all_reduce, reduce_scatter


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


def bucket_fingerprint(params: Sequence[torch.nn.Parameter]) -> List[int]:
    """[count, sum of ids, sum of sizes] of a bucket: equal on every member when the buckets are the same."""
    return [len(params), sum(p.ds_id + 1 for p in params), sum(p.ds_numel for p in params)]


def check_same_bucket(params: Sequence[torch.nn.Parameter], group: Group, names: Dict[int, str],
                      tag: str = "asynchzp.bucket_check") -> None:
    """Every member of `group` is about to reduce the same parameters. A parameter that gets a gradient on some
    ranks and none on others makes the buckets differ, and the reduction that follows would read sizes that do
    not match (gloo aborts the process; NCCL hangs or reads past the end): fail first, naming the parameters.
    Costs one all-gather of 3 integers per bucket on `group`, a host (gloo) group of the reducing thread
    (`ProcessGroups.bucket_check`): the host reads the result without synchronising the device."""
    mine = torch.tensor(bucket_fingerprint(params), dtype=torch.int64)
    every = torch.empty(group.size * 3, dtype=torch.int64)
    with ledger.tagged(tag):
        all_gather(every, mine, group).wait()
    every = every.view(group.size, 3).tolist()
    if all(row == every[0] for row in every):
        return
    listed = ", ".join(names.get(p.ds_id, f"ds_id {p.ds_id}") for p in params[:12])
    more = f" and {len(params) - 12} more" if len(params) > 12 else ""
    others = "; ".join(f"member {i}: {row[0]} parameters, {row[2]} elements" for i, row in enumerate(every))
    raise GradientMismatchError(
        f"ranks of gradient group {group.name} reduced different parameters in the same backward ({others}). "
        f"This rank's bucket: {listed}{more}. A parameter got a gradient on some ranks and none on others "
        "(a branch taken by rank, data-dependent routing without a gradient for every expert). ZeRO-3 needs every "
        "rank to produce the same parameters' gradients in each backward: make the unused branch contribute zero "
        "(e.g. add 0 * branch(x) to the output) so that every rank computes its gradient.")


def fill_bucket(send: torch.Tensor, grads: Sequence[torch.Tensor], atoms: Sequence[int], rows: int,
                world: int) -> None:
    """send [d, width] = the gradients in member order, padded, cast to send's dtype, divided by `world`.

    One pass of the `bucket_add` op where it applies (fp32 / bf16). Multiplying by 1/world equals dividing
    only for a power of two, so other worlds divide in a second pass, as stock does; fp16 (which the op does
    not take) packs with `pack_transposed`."""
    d = send.shape[0]
    power_of_two = world & (world - 1) == 0
    if send.dtype in ops.FLOAT_DTYPES and all(g.dtype in ops.FLOAT_DTYPES for g in grads):
        ops.bucket_add(send.view(-1), grads, atoms, d, rows, scale=1.0 / world if power_of_two else 1.0)
        if not power_of_two:
            send.div_(world)
        return
    offset = 0
    for grad, atom in zip(grads, atoms):
        size = rows * atom
        # The [d, T, atom] region seen as [T, d, atom]: row t, member i <- atom t*d + i.
        pack_transposed(send[:, offset:offset + size].view(d, rows, -1).transpose(0, 1), grad)
        offset += size
    send.div_(world)


class GradReduce:
    def __init__(self, grads: GradShards, group: Group, divisor: int, use_reduce_scatter: bool, runner,
                 quantize: Optional[QuantFormat] = None, tag_prefix: str = "asynchzp",
                 names: Optional[Dict[int, str]] = None, check_group: Optional[Group] = None):
        self.grads = grads
        self.check_group = check_group if check_group is not None else group   # a host group (see check_same_bucket)
        self.names = names or {}      # ds_id -> the parameter's name in the module, for errors
        self.tag = f"{tag_prefix}.grad_reduce_scatter"
        self.check_tag = f"{tag_prefix}.bucket_check"
        self.group = group
        self.divisor = divisor       # what stock divides each gradient by before the sum (the world, by default)
        self.use_reduce_scatter = use_reduce_scatter
        self.quantize = quantize     # wire format of the quantized exchange, or None for full precision
        self.runner = runner
        # Four buckets in flight let one micro-step's reductions run on into the next forward.
        self.staging = StagingRing(slots=4)
        self.scratch = Scratch()     # receive buffer, used only inside reduce jobs
        self.inflight: List = []     # jobs not yet waited for, in submission order

    def reduce_bucket(self, params: Sequence[torch.nn.Parameter], comm_dtype: torch.dtype, first: bool = False,
                      divisor: Optional[int] = None):
        """Pack the bucket's gradients (training thread) and submit their reduction into the gradient shard.
        `first`: the window's first backward, whose sums replace what the shard holds (as Stage 3 copies into its
        partition then; `GradShards` says why that matters). `divisor`: this bucket's, where it is not the usual
        one. Returns the job; the gradients may be freed at once."""
        buffer, d_g = self.grads.buffer, self.group.size
        rows = buffer.rows
        sizes = [rows * buffer.columns[p.ds_id].atom for p in params]
        width = sum(sizes)
        device = params[0].grad.device
        index, send = self.staging.acquire(d_g * width, comm_dtype, device)
        send = send.view(d_g, width)
        fill_bucket(send, [p.grad for p in params], [buffer.columns[p.ds_id].atom for p in params], rows,
                    divisor or self.divisor)
        targets = [buffer.atoms(p) for p in params]
        self.grads.begin_accumulate(params)
        if first:
            self.grads.replace_earlier(params)

        params = list(params)

        def job() -> None:
            if self.check_group.size > 1:
                check_same_bucket(params, self.check_group, self.names, self.check_tag)
            with ledger.tagged(self.tag):
                if self.quantize is not None:
                    mine = self.scratch.get("recv_fp32", width, torch.float32, send.device)
                    quantized.reduce_scatter(mine, send, self.group, self.quantize, self.scratch, segments=sizes)
                elif self.use_reduce_scatter:
                    mine = self.scratch.get("recv", width, comm_dtype, send.device)
                    reduce_scatter(mine, send.view(-1), self.group).wait()
                else:
                    # zero_optimization.reduce_scatter = false: the same sum through an all-reduce, as stock does.
                    all_reduce(send.view(-1), self.group).wait()
                    mine = send[self.group.rank]
            start = 0
            for atoms, size in zip(targets, sizes):
                if first:
                    atoms.copy_(mine[start:start + size].view(atoms.shape))
                else:
                    atoms.add_(mine[start:start + size].view(atoms.shape))
                start += size

        # Where the pack (and any zeroing of the own row) ran, and the training thread's other accesses.
        after = [streams.record()] + self.grads.buffer.host_events()
        pending = self.runner.submit(job, "gradient reduce-scatter", self.group.name, after=after)
        self.staging.hold(index, pending)
        self.inflight.append(pending)
        return pending

    def drain(self) -> None:
        """Wait until every submitted bucket is in the gradient shard."""
        jobs, self.inflight = self.inflight, []
        for job in jobs:
            job.wait()
