"""Every thread and stream of the package, created here and nowhere else.

Three communication threads, one per flow of a step, so that one flow never waits behind another:

* `gather`: the per-micro-step parameter all-gathers (d_p group), run ahead of compute by the prefetch;
* `reduce`: the per-micro-step gradient reduce-scatters (d_g group), one job per gradient bucket as it fills;
* `boundary`: the once-per-step cross-node work (gradient sum into the owners, optimizer-replica all-reduce,
  parameter refresh), overlapped with the last backward and the next forward.

Each issues only on its own process groups (`platform.process_groups.OWNER`). On a device with streams each
has its own stream, at high priority, so its collectives and copies run beside compute; events order them (see
`comm_thread`). With `async_comm: false` the three are inline runners on the training thread: the same jobs, in
the same order, on the same streams.

A context registers itself for interpreter exit, so that a run that never calls `engine.destroy()` still stops
its threads instead of leaving them behind.
"""

from __future__ import annotations

import atexit
import weakref

from ..platform import streams
from .comm_thread import CommThread, InlineRunner
from .peer_monitor import PeerMonitor

FLOWS = ("gather", "reduce", "boundary")

_LIVE: "weakref.WeakSet[CommContext]" = weakref.WeakSet()


class CommContext:
    def __init__(self, async_comm: bool, timeout_s: float, device, rank: int, world: int):
        self.async_comm = async_comm
        self.runners = {}
        self.monitor = PeerMonitor(rank, world)
        for flow in FLOWS:
            # A stream per flow: its copies and collectives are ordered against other streams only through the
            # events its jobs name, never through a shared stream.
            stream = streams.new_stream(device)
            if async_comm:
                self.runners[flow] = CommThread(flow, timeout_s, stream, diagnose=self.monitor.explain)
            else:
                self.runners[flow] = InlineRunner(flow, timeout_s, stream)
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
        """Stop the threads (their queued jobs finish first) and the monitor. Idempotent."""
        for runner in self.runners.values():
            runner.stop()
        self.monitor.close()
        _LIVE.discard(self)


def live_contexts() -> list:
    return list(_LIVE)


@atexit.register
def close_all() -> None:
    """Close every live context: at interpreter exit, and before a process that skips it (`os._exit`) ends."""
    for context in list(_LIVE):
        context.close()

