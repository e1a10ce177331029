"""Gathered-parameter buffers, allocated while the first steps run and reused for the rest of the run.

A full parameter lives in a pool buffer from its gather until the coordinator releases it; the release gives the
buffer back. In steady state every gather finds a free buffer of its size, so nothing is allocated per
collective and the caching allocator never fragments. `allocations` counts misses, for tests.

A buffer is handed out again only when nothing else still references its storage: a view a module kept of a
weight (an autograd-saved `weight.t()`) must not be overwritten by another parameter. Buffers are taken and
given back on the training thread, in program order (the gather job only fills them), so the pool's growth
does not depend on thread timing.

The pool never frees a buffer before `clear`: it keeps one per distinct size (and per concurrent use of that
size) for the whole run. `owned_bytes`, `in_use_bytes` and `peak_in_use_bytes` say what that costs, next to the
model states (`HierarchicalZeroOptimizer.hzp_buffer_bytes`).

On a device with streams, the releaser hands in events recorded where the buffer's last readers ran (compute,
for a published parameter), at release; `acquire` returns them, and the stream that writes the buffer next
waits on them. The pool owns its memory, so `record_stream` would order nothing here. A buffer that was still
referenced when released (a saved view, read again in backward) gets a fresh event on the readers' stream when
it is handed out: by then the view is gone, and every read of it is enqueued before that point.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Sequence, Tuple

import torch

from ..platform import streams


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _storage_users(tensor: torch.Tensor) -> int:
    """References to the tensor's storage, not counting `tensor` itself; 0 when the count is unavailable."""
    if _STORAGE_USE_COUNT is None:
        return 0
    # The temporary untyped_storage() object holds one reference and `tensor` another.
    return int(_STORAGE_USE_COUNT(tensor.untyped_storage()._cdata)) - 2


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _key(numel: int, dtype: torch.dtype, device) -> tuple:
    # The device by its name ("cpu", "cuda:0"), without building a torch.device first: this runs for every parameter
    # of every gather and release.
    return int(numel), dtype, str(device)


class BufferPool:
    def __init__(self):
        # key -> [(buffer, events of its last readers, referenced elsewhere when released)]
        self._free: Dict[Tuple[int, torch.dtype, str], List[tuple]] = {}
        self._lock = threading.Lock()
        self.allocations = 0
        # Bytes of every buffer the pool allocated and still holds; of those handed out and not yet given back;
        # the most ever handed out at once (what the run needed, against what the pool kept).
        self.owned_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0

    def _handed_out(self, nbytes: int) -> None:
        # Under the lock: gathers on the training thread and a report read from another thread see whole updates.
        self.in_use_bytes += nbytes
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)

    def acquire(self, numel: int, dtype: torch.dtype, device, readers_stream=None) -> Tuple[torch.Tensor, list]:
        """A free buffer and the events its next writer waits on. `readers_stream`: where readers of a buffer
        that was still referenced at release run (an event is recorded there now)."""
        key = _key(numel, dtype, device)
        with self._lock:
            candidates = self._free.get(key, [])
            for i, (buffer, events, referenced) in enumerate(candidates):
                if _storage_users(buffer) == 0:
                    del candidates[i]
                    self._handed_out(_nbytes(buffer))
                    break
            else:
                buffer = None
        if buffer is not None:
            if referenced:
                events = events + [streams.record(readers_stream)]
            return buffer, events
        # A new block comes from the caching allocator of the current stream, which hands out memory freed on
        # that stream at once, while kernels of its previous owner may still be queued there: the writer (another
        # stream) waits for them.
        buffer = torch.empty(numel, dtype=dtype, device=device)
        with self._lock:
            self.allocations += 1
            self.owned_bytes += _nbytes(buffer)
            self._handed_out(_nbytes(buffer))
        return buffer, [streams.record()]

    def release(self, buffer: torch.Tensor, events: Sequence = ()) -> None:
        """Give `buffer` back; `events` were recorded where its last readers (or its last writer) ran."""
        key = _key(buffer.numel(), buffer.dtype, buffer.device)
        entry = (buffer, [e for e in events if e is not None], _storage_users(buffer) > 0)
        with self._lock:
            self._free.setdefault(key, []).append(entry)
            self.in_use_bytes -= _nbytes(buffer)

    def clear(self) -> None:
        """Drop the free buffers (teardown); those still handed out stay counted as owned and in use."""
        with self._lock:
            self.owned_bytes -= sum(_nbytes(entry[0]) for entries in self._free.values() for entry in entries)
            self._free.clear()


class StagingRing:
    """Flat send buffers for gradient buckets, used in turn. The training thread packs a bucket into the next
    slot while the reduce thread still sends the previous ones; a slot is packed again only after the job that
    sends it is done (the training thread waits for it: back-pressure when reduction falls behind compute).

    All slots have one capacity, that of the largest bucket so far: buckets of different sizes rotate over the
    slots, so per-slot sizing would keep finding a slot that never held the largest one. A larger bucket (the
    first step shows them all) waits for every slot and reallocates them together."""

    def __init__(self, slots: int = 2):
        self._buffers = [None] * slots
        self._jobs = [None] * slots
        self._next = 0
        self.allocations = 0

    def acquire(self, numel: int, dtype: torch.dtype, device) -> Tuple[int, torch.Tensor]:
        first = self._buffers[0]
        if first is None or first.numel() < numel or first.dtype != dtype or first.device != torch.device(device):
            self.drain()
            capacity = max(numel, first.numel() if first is not None and first.dtype == dtype else 0)
            self._buffers = [torch.empty(capacity, dtype=dtype, device=device) for _ in self._buffers]
            self.allocations += len(self._buffers)
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        job = self._jobs[index]
        if job is not None:
            self._jobs[index] = None
            job.wait()
        return index, self._buffers[index].narrow(0, 0, numel)

    @property
    def slots(self) -> int:
        return len(self._buffers)

    @property
    def capacity(self) -> int:
        """Elements of each slot (0 before the first bucket)."""
        return self._buffers[0].numel() if self._buffers[0] is not None else 0

    @property
    def element_size(self) -> int:
        return self._buffers[0].element_size() if self._buffers[0] is not None else 0

    def nbytes(self) -> int:
        """Bytes of every slot: they all exist from the first bucket on, whether in flight or not."""
        return sum(_nbytes(b) for b in self._buffers if b is not None)

    def hold(self, index: int, job) -> None:
        self._jobs[index] = job

    def drain(self) -> None:
        for index, job in enumerate(self._jobs):
            if job is not None:
                self._jobs[index] = None
                job.wait()
