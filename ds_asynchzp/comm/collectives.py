"""The collectives the hierarchical layout issues, into caller-owned outputs.

Every call goes to the backend object that `deepspeed.comm`'s functions end in (`comm_backend()`), which the
communication ledger wraps, so every byte is counted; not through `deepspeed.comm`'s functions themselves:
with DeepSpeed's `comms_logger` on, those share one set of timers across threads (two threads gathering at
once trip its assertion), synchronise the whole device after every collective (inside a communication thread
that stalls compute and can deadlock against another thread's collective) and end the process with status 0
for an operation name the logger does not know. The ledger times ours instead.

Each collective is issued by the one thread that owns its group (`platform.process_groups.OWNER`);
`delay_injection` can wrap each one in a test-only delay. Every function takes a `Group` record and the output
tensor the caller allocated (from a reusable scratch buffer), and returns a work handle (`None` for a one-rank
group, which never communicates: it degenerates to a local copy). There is no point-to-point anywhere: on NCCL
a lone send/recv pair creates a communicator per rank pair, and a cycle of them deadlocks.
"""

from __future__ import annotations

import time

import torch

from ..platform import ledger
from ..platform.deepspeed_internals import backend_name, comm_backend, ds_comm
from ..platform.process_groups import Group
from . import delay_injection

_NOTHING = object()


class Work:
    """A collective in flight; `wait()` blocks until its output may be read."""

    def __init__(self, handle=_NOTHING):
        self._handle = handle

    def wait(self) -> None:
        if self._handle is not _NOTHING:
            if self._handle is not None:
                self._handle.wait()
            self._handle = _NOTHING
            _injected_delay()


def _injected_delay() -> None:
    """The test-only delay counts as communication the calling thread waited for, like the collective itself."""
    started = time.perf_counter()
    if delay_injection.around():
        ended = time.perf_counter()
        ledger.note_wait(started, ended, "injected delay")
        ledger.note_delay(started, ended)


def _issue(call, *args, **kwargs) -> Work:
    _injected_delay()
    return Work(call(*args, **kwargs))


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False) -> Work:
    """`out` (group.size * inp.numel() elements) receives every member's `inp`, in group rank order."""
    if group.size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp.view(-1))
        return Work()
    return _issue(comm_backend().all_gather_into_tensor, output_tensor=out, input_tensor=inp, group=group.handle,
                  async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False) -> Work:
    """Sum `inp` over the group; member i receives chunk i of group.size equal chunks into `out`."""
    if group.size == 1:
        out.copy_(inp.view(-1))
        return Work()
    return _issue(comm_backend().reduce_scatter_tensor, output_tensor=out, input_tensor=inp, op=ds_comm.ReduceOp.SUM,
                  group=group.handle, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group: Group, async_op: bool = False) -> Work:
    if group.size == 1:
        return Work()
    return _issue(comm_backend().all_reduce, tensor, op=ds_comm.ReduceOp.SUM, group=group.handle, async_op=async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False) -> Work:
    """Member s receives chunk s of every member's `inp`; `out` chunk k comes from member k."""
    if group.size == 1:
        out.copy_(inp)
        return Work()
    return _issue(comm_backend().all_to_all_single, output=out, input=inp, group=group.handle, async_op=async_op)


def broadcast(tensor: torch.Tensor, group: Group, src_index: int = 0) -> Work:
    """Every member receives member `src_index`'s `tensor`."""
    if group.size == 1:
        return Work()
    return _issue(comm_backend().broadcast, tensor=tensor, src=group.ranks[src_index], group=group.handle)


def backend_reduce_scatter_is_optimal(group: Group) -> bool:
    """Whether the backend's reduce-scatter moves only (n-1)/n of the data per rank.

    gloo implements reduce-scatter as an all-reduce (two ring passes: twice the bytes); NCCL's is a single
    ring pass. Where it is not optimal, the boundary uses a pairwise exchange (all-to-all) instead.
    """
    if group.size == 1:
        return True
    return backend_name(group.handle) != "gloo"


def warm_up_groups(creation_order, device) -> None:
    """One one-element all-reduce on each group this rank belongs to, on the calling (training) thread, in the
    order the groups were created (the same on every rank, so no two ranks wait on each other in a cycle).

    Where `torch.distributed` was initialised without `device_id`, NCCL creates a group's communicator at its
    first collective; without this that would be on a communication thread, while other communicators' kernels
    run, where `ncclCommInitRank` can deadlock. It also finds an unreachable peer at construction, naming the
    group, rather than in the middle of a step."""
    me = ds_comm.get_rank()
    probe = torch.ones(1, dtype=torch.float32, device=device)
    with ledger.tagged("group_warm_up"):
        for handle, ranks, name in creation_order:
            if me not in ranks:
                continue
            try:
                comm_backend().all_reduce(probe, ds_comm.ReduceOp.SUM, handle, False)
            except Exception as error:
                raise RuntimeError(f"async_hzp: the first collective on process group '{name}' (global ranks "
                                   f"{list(ranks)}) failed while the groups were being set up: {error}") from error
