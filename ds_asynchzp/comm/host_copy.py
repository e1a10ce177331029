"""With optimizer states on the host, the copies between the device's shards and the host optimizer's tensors, on
streams of their own.

To the host (`GradToHost`): the summed gradient columns of a chunk, from the gradient shard's own row into the host
optimizer's fp32 gradients, inside the boundary's chunk job once the chunk's cross-node sum is done (an event
recorded on the job's stream after the sum), so the copy of chunk k overlaps the exchange of chunk k+1. The
gradient is cast to fp32 on the device first, as stock ZeRO-3 does before its copy, so 4 bytes per element cross
to the host. The host reads a chunk's gradients only after blocking on that chunk's copy (`host_wait_chunks`, or
all of them: `host_wait`); the current stream waits for every copy (`wait`) before anything rewrites the own row.

Back to the device (`ParamsToDevice`): a stepped piece of the host's fp32 master weights, cast on the host into a
pinned staging slot in the parameter dtype (so what crosses is the parameter's bytes, as stock's copy), then copied
into the parameter shard's own row on a stream of its own (not behind the window's last copies to the host), never a
blocking copy on the training thread. Two slots alternate (the second made only once a step has a second piece):
the host casts piece k+1 while piece k crosses, and blocks on a slot's previous copy before it rewrites it. The
buffer notes the copy on the copy stream, so the piece's refresh waits for it.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from deepspeed.accelerator import get_accelerator

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
        self._done: Dict[int, object] = {}     # chunk index -> event on the copy stream after its copy, this window

    def after_sum(self, index: int, segments: List[Segment]):
        """The part of chunk `index`'s job that runs after the chunk's sum: copy `segments` to the host."""
        if not segments:
            return None

        def copy() -> None:
            with ledger.boundary_phase("copy_out"):
                copy_out()

        def copy_out() -> None:
            summed = streams.record()         # the job's stream, after the sum
            with streams.use(self.copy_stream):
                self._after(summed)
                nbytes = 0
                for start, end, host in segments:
                    host.copy_(self.buffer.own[start:end].to(host.dtype), non_blocking=True)
                    nbytes += host.numel() * host.element_size()
                done = streams.record(self.copy_stream)
            with self._lock:
                self._done[index] = done
            ledger.note_host_copy("to_host", nbytes)

        return copy

    def _after(self, summed) -> None:
        """The copy stream waits for the chunk's sum (and, through the job's stream, for what the job waited on:
        the host's reads of the previous window's host gradients)."""
        streams.wait(summed)

    def host_wait_chunks(self, indices) -> None:
        """Block until the copies of these chunks have ended (their jobs are done), before the host reads them."""
        with self._lock:
            events = [self._done.get(i) for i in indices]
        for event in events:
            if event is not None:
                event.synchronize()

    def host_wait(self) -> None:
        """Block until every copy of the window has ended."""
        with self._lock:
            indices = list(self._done)
        self.host_wait_chunks(indices)

    def wait(self) -> None:
        """The current stream waits for every copy of the window (the chunk jobs themselves are done); the window's
        copies are then forgotten."""
        with self._lock:
            done, self._done = list(self._done.values()), {}
        streams.wait(done)


class ParamsToDevice:
    SLOTS = 2

    def __init__(self, copy_stream):
        self.copy_stream = copy_stream
        # Per parameter dtype: the pinned slots, each made when first used (a step of one piece uses one).
        self._slots: Dict[torch.dtype, List[Optional[torch.Tensor]]] = {}
        self._capacity: Dict[torch.dtype, int] = {}               # elements each slot of a dtype holds
        self._copied: List[object] = [None] * self.SLOTS           # per slot index: event after its latest copy
        self._next = 0
        self._last = None                                          # event after the latest copy of all

    def begin(self) -> None:
        """Before the first piece of a step: the copy stream waits for what the current stream did to the own row
        (its readers before the step: the previous refresh, the gathers, a checkpoint save). Pieces start from the
        first slot again."""
        streams.wait(streams.record(), self.copy_stream)
        self._next = 0

    def reserve(self, numel: int, dtype: torch.dtype) -> None:
        """Slots of `dtype` for pieces of up to `numel` elements, sized before the pieces (a slot replaced while its
        copy runs would have to be waited for). Grows only."""
        if self._capacity.get(dtype, 0) >= numel:
            return
        for event in self._copied:
            if event is not None:
                event.synchronize()
        self._capacity[dtype] = numel
        self._slots[dtype] = [None] * self.SLOTS

    def copy(self, master: torch.Tensor, buffer: ShardedBuffer, start: int, zeroed: Sequence[Tuple[int, int]]) -> None:
        """Copy `master` (host fp32, a stepped piece) into columns [start, start + numel) of `buffer`'s own row;
        `zeroed` are column ranges inside it (the own atoms' padding) written as zeros, as after a whole step."""
        with ledger.boundary_phase("copy_back"):
            self._copy(master, buffer, start, zeroed)

    def _copy(self, master, buffer, start, zeroed) -> None:
        numel, dtype = master.numel(), buffer.data.dtype
        self.reserve(numel, dtype)
        event = self._copied[self._next]
        if event is not None:
            event.synchronize()                    # the slot's previous copy has ended
        slots = self._slots[dtype]
        if slots[self._next] is None:
            slots[self._next] = get_accelerator().pin_memory(torch.empty(self._capacity[dtype], dtype=dtype))
        staging = slots[self._next][:numel]
        staging.copy_(master)                      # the cast, on the host
        for lo, hi in zeroed:
            staging[lo - start:hi - start].zero_()
        with streams.use(self.copy_stream):
            buffer.own[start:start + numel].copy_(staging, non_blocking=True)
            buffer.note_host_access()              # the refresh of these columns waits for this copy
            self._copied[self._next] = self._last = streams.record(self.copy_stream)
        self._next = (self._next + 1) % self.SLOTS
        ledger.note_host_copy("to_device", numel * staging.element_size())

    def end(self) -> None:
        """After the last piece of a step: the current stream waits for the copies (it writes the own row next:
        padding, a checkpoint load)."""
        streams.wait(self._last)

    def staging_bytes(self) -> int:
        """Host bytes of the staging slots (pinned where the device has streams)."""
        return sum(t.numel() * t.element_size() for slots in self._slots.values() for t in slots if t is not None)
