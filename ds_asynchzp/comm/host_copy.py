"""With optimizer states on the host: the copy of summed gradient columns from the device's gradient shard into the
host optimizer's fp32 gradients, inside the boundary's chunk jobs.

A chunk's copy runs on the boundary flow's copy stream once that chunk's cross-node sum is done (an event recorded
on the job's stream after the sum), so the copy of chunk k overlaps the exchange of chunk k+1 on the boundary's
own stream. The copies of a window are waited for on the current stream (`wait`) before anything rewrites the own row; the
host reads the gradients only after blocking on an event recorded there afterwards (`HostOffload.host_wait`).
The gradient is cast to fp32 on the device first, as stock ZeRO-3 does before its copy, so 4 bytes per element
cross to the host.
"""

from __future__ import annotations

import threading
from typing import List, Tuple

import torch

from ..platform import ledger
from ..platform import streams
from ..state.sharded_buffer import ShardedBuffer

# (first column, end column, the host tensor that receives columns [first, end) of the own row)
Segment = Tuple[int, int, torch.Tensor]


class GradToHost:
    def __init__(self, buffer: ShardedBuffer, copy_stream):
        self.buffer = buffer
        self.copy_stream = copy_stream
        self._lock = threading.Lock()
        self._done: List[object] = []     # events on the copy stream, one per chunk copied this window

    def after_sum(self, segments: List[Segment]):
        """The part of a chunk job that runs after the chunk's sum: copy `segments` to the host."""
        if not segments:
            return None

        def copy() -> None:
            summed = streams.record()         # the job's stream, after the sum
            with streams.use(self.copy_stream):
                self._after(summed)
                nbytes = 0
                for start, end, host in segments:
                    host.copy_(self.buffer.own[start:end].to(host.dtype), non_blocking=True)
                    nbytes += host.numel() * host.element_size()
                done = streams.record(self.copy_stream)
            with self._lock:
                self._done.append(done)
            ledger.note_host_copy("to_host", nbytes)

        return copy

    def _after(self, summed) -> None:
        """The copy stream waits for the chunk's sum (and, through the job's stream, for what the job waited on:
        the host's reads of the previous window's host gradients)."""
        streams.wait(summed)

    def wait(self) -> None:
        """The current stream waits for every copy of the window (the chunk jobs themselves are done)."""
        with self._lock:
            done, self._done = self._done, []
        streams.wait(done)
