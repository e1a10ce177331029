"""One order in which a rank's communication threads issue their collectives, the same on every rank.

NCCL runs the kernels of a device's communicators on that device's queues. Collectives on different
communicators, issued from several threads, must reach it in the same order on every rank: otherwise rank A
may block in communicator X's kernel waiting for B, while B blocks in Y's waiting for A (certain with
`CUDA_DEVICE_MAX_CONNECTIONS=1`, where all streams share one hardware queue, and possible whenever a device-wide
synchronisation happens in any thread). gloo has no such constraint: each group has its own connections.

The order is decided where it is the same on every rank: on the training thread, at submit. Every job takes the
next ticket there (`ticket`); a thread starts a job only once every job with a lower ticket has finished
issuing (`turn`), and passes the turn on when its job returns, also when it failed or was skipped. A job waits
only on jobs submitted before it, so the lowest unfinished ticket can always run: no cycle. On CUDA a job's
function returns once its kernels are enqueued, so the turn costs an enqueue; where a collective returns only
once complete (gloo on CPU), the threads' jobs run one at a time, still beside compute.

The training thread issues collectives of its own too (DeepSpeed's: the step's norm, the coordinator's
consistency checks after the first step, checkpoint broadcasts, Ulysses SP's all-to-alls; and the user's: a
loss all-gathered over a sequence-parallel group with `torch.distributed.nn.functional`, a logging all-reduce).
With the total order they take a ticket at the call and wait for their turn: `guard_backend` wraps DeepSpeed's
backend object, where every collective through `deepspeed.comm` ends, and `torch.distributed`'s collective
functions, which user code and `torch.distributed.nn` call directly. A call made inside a turn (a job's, or a
DeepSpeed call that reaches `torch.distributed`) is part of that turn. Not covered: collectives through
`torch.distributed`'s functional or compiled APIs, and process-group objects called directly.

With the order "per_thread" (the default on CPU) tickets are still taken and the last started job is still
known, for the diagnosis of a timeout; only the waiting for turns is off.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed

from ..errors import CommTimeoutError
from ..platform.deepspeed_internals import comm_backend

# The backend's methods that issue a collective (those it has: the set differs between DeepSpeed's backends).
_ISSUING_METHODS = ("all_gather_into_tensor", "all_gather", "all_gather_coalesced", "all_gather_object",
                    "reduce_scatter_tensor", "reduce_scatter", "all_reduce", "all_reduce_coalesced", "broadcast",
                    "broadcast_object_list", "reduce", "all_to_all_single", "all_to_all", "gather", "scatter",
                    "barrier", "monitored_barrier")


# torch.distributed's module-level collectives, which user code and torch.distributed.nn call by attribute.
_TORCH_DISTRIBUTED_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
                                  "_all_gather_base", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor",
                                  "_reduce_scatter_base", "broadcast", "broadcast_object_list", "reduce", "gather",
                                  "scatter", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier")


@dataclass(frozen=True)
class Issued:
    """The latest job a rank started issuing: its ticket, flow (thread), what it does and on which group."""
    ticket: int
    flow: str
    what: str
    group: str

    def describe(self) -> str:
        return f"#{self.ticket} {self.what} on '{self.group}' ({self.flow} thread)"


class IssueOrder:
    def __init__(self, total: bool, timeout_s: float):
        self.total = total
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._turn = 0                    # total order: the ticket that may issue now
        self.last: Optional[Issued] = None
        self._local = threading.local()   # .holding: the calling thread is inside a turn
        self._guarded: dict = {}           # (owner, name) -> (original, our wrapper) while guard_backend is on

    def ticket(self) -> int:
        """The next position in the order; taken on the training thread, in program order."""
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    @contextlib.contextmanager
    def turn(self, ticket: int, flow: str, what: str, group: str):
        """Inside: this job may issue its collectives. With the total order, first wait until every lower ticket has
        finished; a wait longer than the communication timeout means an earlier job is stuck on a collective."""
        with self._cond:
            if self.total:
                deadline = time.monotonic() + self.timeout_s
                while self._turn != ticket:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        latest = self.last.describe() if self.last else "none"
                        raise CommTimeoutError(
                            f"{what} on process group '{group}' (#{ticket}) waited {self.timeout_s:.0f} s for its turn "
                            f"to issue: job #{self._turn} has not finished issuing (the latest job started on this "
                            f"rank: {latest}); an earlier collective is stuck")
                    self._cond.wait(left)
            if self.last is None or ticket > self.last.ticket:    # threads may start out of order (per_thread)
                self.last = Issued(ticket, flow, what, group)
        self._local.holding = True
        try:
            yield
        finally:
            self._local.holding = False
            with self._cond:
                self._turn = max(self._turn, ticket + 1)
                self._cond.notify_all()

    def snapshot(self) -> dict:
        """What the peers read when one of them times out: the latest job started and the next ticket."""
        last = self.last
        return {"started": last.ticket if last else -1, "what": last.describe() if last else "nothing yet",
                "submitted": self._next_ticket}

    # ------------------------------------------------------------------ the training thread's own collectives
    def guard_backend(self) -> None:
        """With the total order: every collective issued outside a job (DeepSpeed's and the user's, on the training
        thread) takes the next ticket and waits for its turn. Undone by `release_backend`."""
        if not self.total or self._guarded:
            return
        owners = [(comm_backend(), _ISSUING_METHODS, "DeepSpeed's"),
                  (torch.distributed, _TORCH_DISTRIBUTED_COLLECTIVES, "torch.distributed's")]
        for owner, methods, whose in owners:
            for method in methods:
                original = getattr(owner, method, None)
                if original is not None:
                    wrapper = self._ordered(f"{whose} {method}", original)
                    self._guarded[(owner, method)] = (original, wrapper)
                    setattr(owner, method, wrapper)

    def release_backend(self) -> None:
        for (owner, method), (original, wrapper) in self._guarded.items():
            # Put the original back only where ours is still outermost; a wrapper installed over ours (the ledger's)
            # keeps calling ours, which from now on passes every call through.
            if getattr(owner, method, None) is wrapper:
                setattr(owner, method, original)
        self._guarded = {}

    def _ordered(self, what: str, original):
        def issue(*args, **kwargs):
            if not self._guarded or getattr(self._local, "holding", False):
                return original(*args, **kwargs)
            with self.turn(self.ticket(), "training", what, "a group of the caller's"):
                return original(*args, **kwargs)

        issue.__wrapped__ = original
        return issue
