"""A gradient read that starts the window's cross-node sum is done by every rank, or ends with an error naming it.

Under stock ZeRO-3, `optimizer.averaged_gradients`, `safe_get_local_fp32_grad` and the other readers of the
gradient partitions read local state. Here, inside an accumulation window, the own atoms hold node-only sums: such
a read needs the window's cross-node sum first, a collective. Done on a subset of ranks (a logger on rank 0), it
would wait for peers that never join it, until `comm_timeout_s`, and meanwhile its peers' collectives would match
the wrong ones. So the ranks agree in the rendezvous store, with two atomic counters per point of a window, keyed
by the window's index `w` (window sums this rank started) and the forwards `m` it has started in that window:

* a rank starting its `m`-th forward of window `w` adds 1 to ``w/fwd<m>`` and checks ``w/read<m-1>``: a peer
  that read after `m - 1` forwards while this rank goes on training is a mismatch (this rank records it in the
  store and raises);
* a rank reading after `m` forwards adds 1 to ``w/read<m>`` and waits until all `world` ranks have, or until a
  peer has started forward `m + 1` or recorded a mismatch (then it raises).

The bound: a mismatch ends the reading rank as soon as a peer starts its next forward (polled at most every
`MAX_POLL_S`), and a peer that starts a forward after the read was announced at that forward. A peer that had
started its next forward before the read was announced, or that is blocked in a collective the reader did not
issue (the window's own sum in its last backward), learns of it when the reader's process ends (the peer
monitor), or at `comm_timeout_s`. The cost: two store operations per forward on more than one rank, none per
collective; rank 0 deletes a window's keys two windows later, so the store holds a bounded number of them.
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

from ..errors import GradientReadMismatch
from .peer_monitor import rendezvous_store

POLL_S = 0.005        # the first wait between two looks at the store; doubled up to MAX_POLL_S
MAX_POLL_S = 0.1
_INSTANCES = itertools.count()   # engines made in this process: each rank makes them in the same order


class ReadAgreement:
    def __init__(self, store, rank: int, world: int, instance: int, timeout_s: float):
        """`store`: the rendezvous store (None: no agreement, the read waits in its collective); `instance`:
        this engine's index among the process's engines, the same on every rank."""
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.prefix = f"asynchzp/{instance}/reads"
        self.window = 0      # window sums this rank has started
        self.forwards = 0    # forwards started in the current window
        self._forwards_of: dict = {}   # window -> its forwards, until rank 0 deletes its keys

    @classmethod
    def for_engine(cls, rank: int, world: int, timeout_s: float) -> "ReadAgreement":
        return cls(rendezvous_store(), rank, world, next(_INSTANCES), timeout_s)

    def _key(self, name: str, window: Optional[int] = None) -> str:
        return f"{self.prefix}/w{self.window if window is None else window}/{name}"

    def _count(self, name: str) -> int:
        return int(self.store.add(self._key(name), 0))

    def forward_started(self) -> None:
        """Called at every forward of the engine, before it issues anything."""
        self.forwards += 1
        if self.store is None or self.world == 1:
            return
        self.store.add(self._key(f"fwd{self.forwards}"), 1)
        if self.world > 1 and self._count(f"read{self.forwards - 1}"):
            what = self._read_name(self.forwards - 1)
            message = (f"rank {self.rank} started a forward where another rank read the gradients ({what}) before "
                       "it; that read needs the window's cross-node sum, a collective, so every rank must do it")
            self.store.set(self._key("mismatch"), message)
            raise GradientReadMismatch(_with_fix(message))

    def window_sum_started(self) -> None:
        """A window's cross-node sum starts here (its last backward, `step`, `zero_grad`, or a read)."""
        self._forwards_of[self.window] = self.forwards
        self.window += 1
        self.forwards = 0
        old = self.window - 3
        if old in self._forwards_of:
            forwards = self._forwards_of.pop(old)
            if self.rank == 0 and self.store is not None and self.world > 1:
                # Every rank has left that window two windows ago: the sum of the window after it needed them all.
                for m in range(forwards + 1):
                    for name in (f"fwd{m}", f"read{m}", f"read{m}/what"):
                        self.store.delete_key(self._key(name, old))
                self.store.delete_key(self._key("mismatch", old))

    def read_starts_window_sum(self, what: str) -> None:
        """Before a read (`what`, as the user wrote it) starts the window's cross-node sum: wait until every rank
        reads here too, or raise."""
        if self.store is None or self.world == 1:
            return
        point = f"read{self.forwards}"
        self.store.set(self._key(f"{point}/what"), what)
        self.store.add(self._key(point), 1)
        deadline, pause = time.monotonic() + self.timeout_s, POLL_S
        while self._count(point) < self.world:
            went_on = self._count(f"fwd{self.forwards + 1}")
            mismatch = self.store.check([self._key("mismatch")])
            if went_on or mismatch or time.monotonic() > deadline:
                why = ("ranks went on to their next forward instead" if went_on or mismatch else
                       f"not every rank did it within {self.timeout_s:g} s (async_hzp.comm_timeout_s)")
                message = (f"rank {self.rank} read the gradients inside an accumulation window ({what}), which "
                           f"needs the window's cross-node sum, a collective: {self._count(point)} of {self.world} "
                           f"ranks did the read, and {why}")
                self.store.set(self._key("mismatch"), message)
                raise GradientReadMismatch(_with_fix(message))
            time.sleep(pause)
            pause = min(2 * pause, MAX_POLL_S)

    def _read_name(self, forwards: int) -> str:
        key = self._key(f"read{forwards}/what")
        return self.store.get(key).decode() if self.store.check([key]) else "a gradient read"


def _with_fix(message: str) -> str:
    return (f"{message}. Under async_hzp the gradient partitions hold node-only sums until the window's last "
            "backward; read them after engine.step() (or after the window's last backward), or on every rank at "
            "the same point.")


__all__ = ["ReadAgreement"]
