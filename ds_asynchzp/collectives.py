"""The few collective patterns the hierarchical layout needs, all through `deepspeed.comm`.

Going through `deepspeed.comm` (not `torch.distributed`) keeps every byte visible to the communication
ledger and to DeepSpeed's own comms logger. Groups of one rank never communicate: callers pass `group_size`
and a one-rank call degenerates to a copy, because `None` would mean "the world group" to torch.
"""

from __future__ import annotations

import torch

from .deepspeed_internals import ds_comm


def all_gather_flat(shard: torch.Tensor, group, group_size: int) -> torch.Tensor:
    """Concatenate every member's equal-sized `shard`, in group rank order."""
    if group_size == 1:
        return shard.clone()
    out = torch.empty(group_size * shard.numel(), dtype=shard.dtype, device=shard.device)
    ds_comm.all_gather_into_tensor(out, shard.contiguous(), group=group)
    return out


def reduce_scatter_flat(flat: torch.Tensor, group, group_size: int) -> torch.Tensor:
    """Sum `flat` over the group; member i keeps chunk i of `group_size` equal chunks."""
    if group_size == 1:
        return flat.clone()
    out = torch.empty(flat.numel() // group_size, dtype=flat.dtype, device=flat.device)
    ds_comm.reduce_scatter_tensor(out, flat.contiguous(), op=ds_comm.ReduceOp.SUM, group=group)
    return out


def permute(send: torch.Tensor, send_to: int, recv_from: int, group) -> torch.Tensor:
    """Every rank sends one tensor to one peer and receives an equal-sized one from another.

    The receive is posted before the send: gloo sends a buffer only once the peer is ready to receive, and
    that notice travels on the same connection as bulk data.
    """
    me = ds_comm.get_rank()
    if send_to == me and recv_from == me:
        return send.clone()
    received = torch.empty_like(send)
    recv_work = ds_comm.irecv(received, src=recv_from, group=group) if recv_from != me else None
    send_work = ds_comm.isend(send.contiguous(), dst=send_to, group=group) if send_to != me else None
    if recv_from == me:
        received.copy_(send)
    if send_work is not None:
        send_work.wait()
    if recv_work is not None:
        recv_work.wait()
    return received
