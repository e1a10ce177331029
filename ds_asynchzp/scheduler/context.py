"""Every thread and stream of the package, created here and nowhere else.

Three communication threads, one per flow of a step, so that one flow never waits behind another:

* `gather`: the per-micro-step parameter all-gathers (d_p group), run ahead of compute by the prefetch;
* `reduce`: the per-micro-step gradient reduce-scatters (d_g group), one job per gradient bucket as it fills;
* `boundary`: the once-per-step cross-node work (gradient sum into the owners, optimizer-replica all-reduce,
  parameter refresh), overlapped with the last backward and the next forward; with optimizer offload its jobs also
  copy each summed chunk to the host, on a second stream (`copy_stream`), and the host step copies each stepped
  piece back on a third (`copy_back_stream`).

Each issues only on its own process groups (`platform.process_groups.OWNER`). On a device with streams each
has its own stream, at high priority, so its collectives and copies run beside compute; events order them (see
`comm_thread`). With `async_comm: false` the three are inline runners on the training thread: the same jobs, in
the same order, on the same streams. So is a flow named in `inline_flows`, decided from the configuration (the
same on every rank): one whose every job is waited for as soon as it is submitted (the gathers, when nothing is
gathered ahead), where a thread could overlap nothing and would only add two hand-offs per job.

Across the threads, collectives are issued in one order per rank, the same on every rank, where the device
needs it (`issue_order`: by default on a device with streams). A context also closes cleanly: its threads
finish their jobs, its streams are synchronised before the process groups can go.

A context registers itself for interpreter exit, so that a run that never calls `engine.destroy()` still stops
its threads instead of leaving them behind.
"""

from __future__ import annotations

import atexit
import os
import warnings
import weakref

from ..platform import streams
from .comm_thread import CommThread, InlineRunner
from .issue_order import IssueOrder
from .peer_monitor import PeerMonitor

FLOWS = ("gather", "reduce", "boundary")

_LIVE: "weakref.WeakSet[CommContext]" = weakref.WeakSet()


def flows_waited_at_once(prefetch_depth: int, coordinator_prefetches: bool) -> tuple:
    """The flows whose every job is waited for as soon as it is submitted (`inline_flows`): the gathers, when
    neither AsyncHZP's replay (`prefetch_depth`) nor DeepSpeed's coordinator asks for any ahead of its use."""
    return () if prefetch_depth > 0 or coordinator_prefetches else ("gather",)


class CommContext:
    def __init__(self, async_comm: bool, timeout_s: float, device, rank: int, world: int, issue_order: str = "auto",
                 inline_flows: tuple = (), host_copies: bool = False):
        self.async_comm = async_comm
        self.runners = {}
        total = issue_order == "total" or (issue_order == "auto" and streams.has_streams())
        if not total and streams.has_streams() and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            warnings.warn("async_hzp.issue_order is 'per_thread' while CUDA_DEVICE_MAX_CONNECTIONS=1: every stream "
                          "then shares one hardware queue, and collectives the threads issue in different orders on "
                          "different ranks can deadlock. Remove issue_order (or set it to 'total').", RuntimeWarning,
                          stacklevel=2)
        self.order = IssueOrder(total, timeout_s)
        self.monitor = PeerMonitor(rank, world, progress=self.order.snapshot)
        for flow in FLOWS:
            # A stream per flow: its copies and collectives are ordered against other streams only through the
            # events its jobs name, never through a shared stream.
            stream = streams.new_stream(device)
            if async_comm and flow not in inline_flows:
                self.runners[flow] = CommThread(flow, timeout_s, self.order, stream, diagnose=self.monitor.explain)
            else:
                self.runners[flow] = InlineRunner(flow, timeout_s, self.order, stream, diagnose=self.monitor.explain)
        # With optimizer offload, the boundary's copies to the host run on a stream of their own, so that a chunk's
        # copy overlaps the next chunk's exchange on the boundary stream; the stepped pieces' copies back on
        # another, so that they do not queue behind the window's last copies to the host.
        self.copy_stream = streams.new_stream(device) if host_copies else None
        self.copy_back_stream = streams.new_stream(device) if host_copies else None
        self.order.guard_backend()
        self.monitor.start()
        _LIVE.add(self)

    @property
    def gather(self):
        return self.runners["gather"]

    @property
    def reduce(self):
        return self.runners["reduce"]

    @property
    def boundary(self):
        return self.runners["boundary"]

    def busy_seconds(self) -> dict:
        return {flow: runner.busy_s for flow, runner in self.runners.items()}

    def close(self) -> None:
        """Stop the threads (their queued jobs finish first), wait until each flow's stream has run what the jobs
        enqueued (a job whose function returned has only enqueued its kernels: the process groups must not be
        destroyed under them), and stop the monitor. Idempotent."""
        for runner in self.runners.values():
            runner.stop()
        for runner in self.runners.values():
            streams.synchronize(runner.stream)
        streams.synchronize(self.copy_stream)
        streams.synchronize(self.copy_back_stream)
        self.order.release_backend()
        self.monitor.close()
        _LIVE.discard(self)


def live_contexts() -> list:
    return list(_LIVE)


@atexit.register
def close_all() -> None:
    """Close every live context: at interpreter exit, and before a process that skips it (`os._exit`) ends."""
    for context in list(_LIVE):
        context.close()

