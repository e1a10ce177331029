"""The loss of one sequence split over a sequence-parallel group: ALST's aggregation, with its collectives on
`deepspeed.comm`.

Under Ulysses sequence parallelism each rank of an SP group computes the loss of its slice of the sequence; the
sequence's loss is the token-weighted mean over the group. ALST's recipe takes it with
`torch.distributed.nn.functional.all_gather`, which goes around `deepspeed.comm`: on NCCL that collective is outside
AsyncHZP's one issue order (`issue_order: total`), and on gloo (torch 2.13) its backward fails for an SP group
without global rank 0. This function computes the same value with the same gradient: forward, an all-gather of the
per-rank sums and token counts; backward, an all-reduce of the incoming gradients and this rank's element of it,
which is what the all-gather's backward computes (each rank's loss gets the sum over the group's ranks of the
gradient that flows to it, `sp` times its share). ZeRO-3's default gradient average divides by the whole world,
`sp` times the data-parallel size, which takes that factor out, so training matches a run without SP.
"""

from __future__ import annotations

import torch

from ..platform.deepspeed_internals import ds_comm


class _GatherScalars(torch.autograd.Function):
    """[value of rank 0, value of rank 1, ...] over `group`, differentiable."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        ctx.index = ds_comm.get_rank(group=group)
        parts = [torch.empty_like(value) for _ in range(ds_comm.get_world_size(group=group))]
        ds_comm.all_gather(parts, value.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.contiguous().clone()
        ds_comm.all_reduce(summed, group=ctx.group)
        return summed[ctx.index], None


def sequence_parallel_loss(loss_sum: torch.Tensor, num_tokens, group) -> torch.Tensor:
    """The mean loss per token of the sequence the SP `group` shares: `loss_sum` is this rank's summed loss over its
    slice and `num_tokens` the tokens it counted (labels not ignored). Every rank gets the same value; call
    `engine.backward` on it on every rank. A rank whose slice has no token passes 0 and 0."""
    loss_sum = loss_sum.reshape(())
    tokens = torch.as_tensor(num_tokens, device=loss_sum.device).to(loss_sum.dtype).reshape(())
    sums = _GatherScalars.apply(loss_sum, group)
    with torch.no_grad():
        counts = [torch.empty_like(tokens) for _ in range(ds_comm.get_world_size(group=group))]
        ds_comm.all_gather(counts, tokens, group=group)
    return sums.sum() / torch.stack(counts).sum().clamp(min=1)
