"""Gathered-parameter buffers, reused from one gather to the next and trimmed once per optimizer step.

A full parameter lives in a pool buffer from its gather until the coordinator releases it; the release gives the
buffer back. `allocations` counts misses, for tests; `frees` the buffers given back to the allocator.

Size classes. A request of `n` elements belongs to the class `k = floor(log2 n)` of its dtype and device, and is
served by the smallest free buffer of its class that holds `n` (best fit, most recently given back first among
equals), handed out as a view of its first `n` elements: a buffer is never more than twice its request. A miss
frees the free buffers of the class (all smaller than `n`, or they would have served it) and allocates one as large
as the largest of the class still owned, at least `n`: the class's buffers converge to one size and serve any of
its requests, so a class owns no more buffers than it ever had in use at once (below).

Trimming. `trim` runs once per optimizer step on the training thread. Per class it keeps the buffers in use and,
of the free ones handed out or given back during the step, the largest, up to the most that were in use at once
during the step; it frees the others. In a steady loop each step asks for the same buffers, so nothing is freed
or allocated after warm-up, while sizes seen only once (construction, a load, an unusual step) go at the next
trim. After a trim the pool owns at most `2 * sum_k P_k + R` bytes (`bound_bytes`): `P_k` the most bytes requested
at once in class `k` during the step (a class-k buffer is below `2^(k+1)` elements, and `C_k` buffers in use at
once hold at least `C_k * 2^k`), `R` the free buffers still referenced by a view (they cannot be freed).

A buffer is handed out again, or freed, only when nothing else still references its storage: a view a module kept
of a weight (an autograd-saved `weight.t()`) must not be overwritten by another parameter, nor its memory go back
to the allocator while it is read. Buffers are taken, given back and trimmed on the training thread, in program
order (the gather job only fills them), so the pool's growth does not depend on thread timing.

On a device with streams, the releaser hands in events recorded where the buffer's last readers ran (compute,
for a published parameter), at release; `acquire` returns them, and the stream that writes the buffer next
waits on them. The pool owns its memory, so `record_stream` would order nothing here. A buffer that was still
referenced when released (a saved view, read again in backward) gets a fresh event on the readers' stream when
it is handed out or freed: by then the view is gone, and every read of it is enqueued before that point. A
buffer goes back to the caching allocator only after the stream it was allocated on waits on those events: the
allocator hands a freed block to the next allocation on that stream at once.
"""

from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

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


def _class(numel: int, dtype: torch.dtype, device) -> tuple:
    # The device by its name ("cpu", "cuda:0"), without building a torch.device first: this runs for every parameter
    # of every gather and release. Class -1 holds the empty requests.
    return int(numel).bit_length() - 1, dtype, str(device)


class _Entry:
    """One buffer the pool owns: where it was allocated, and what its next writer (or its free) must wait on."""

    __slots__ = ("base", "klass", "alloc_stream", "events", "referenced", "touched", "views", "requested")

    def __init__(self, base: torch.Tensor, klass: tuple, alloc_stream):
        self.base, self.klass, self.alloc_stream = base, klass, alloc_stream
        self.events: list = []
        self.referenced = False     # still referenced elsewhere when given back
        self.touched = True         # handed out or given back since the last trim
        # numel -> weak reference to the narrowed view handed out for it. The same view is handed out again for the
        # same size: a caller may keep the one it gave back (a finished job's result), as it keeps `base` itself.
        self.views: Dict[int, weakref.ref] = {}
        self.requested = 0          # bytes of the request it serves while handed out

    def view(self, numel: int) -> torch.Tensor:
        if numel == self.base.numel():
            return self.base
        ref = self.views.get(numel)
        view = ref() if ref is not None else None
        if view is None:
            self.views = {n: r for n, r in self.views.items() if r() is not None}
            view = self.base.narrow(0, 0, numel)
            self.views[numel] = weakref.ref(view)
        return view

    def users(self) -> int:
        """References to the storage other than the pool's own: the base and the views it handed out."""
        if _STORAGE_USE_COUNT is None:
            return 0
        handed = sum(1 for ref in self.views.values() if ref() is not None)
        return _storage_users(self.base) - handed


class BufferPool:
    def __init__(self):
        self._free: Dict[tuple, List[_Entry]] = {}     # class -> free buffers, most recently given back last
        self._lent: Dict[int, tuple] = {}               # id of the view handed out -> (its buffer, the view)
        self._lock = threading.Lock()
        self.allocations = 0
        self.frees = 0
        # Bytes of every buffer the pool allocated and still holds; of those handed out and not yet given back;
        # the most ever handed out at once (what the run needed, against what the pool kept).
        self.owned_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        # Per class, since the last trim: buffers and requested bytes in use now, and the most at once.
        self._count: Dict[tuple, int] = {}
        self._requested: Dict[tuple, int] = {}
        self._peak_count: Dict[tuple, int] = {}
        self._peak_requested: Dict[tuple, int] = {}
        # What the last trim left the pool at most (module docstring); None before the first trim.
        self.bound_bytes: Optional[int] = None

    # ------------------------------------------------------------------------------ counters (under the lock)
    def _lend(self, entry: _Entry, numel: int) -> torch.Tensor:
        base = entry.base
        view = entry.view(numel)
        entry.requested = numel * base.element_size()
        entry.touched = True
        self._lent[id(view)] = (entry, view)
        klass = entry.klass
        self._count[klass] = self._count.get(klass, 0) + 1
        self._requested[klass] = self._requested.get(klass, 0) + entry.requested
        self._peak_count[klass] = max(self._peak_count.get(klass, 0), self._count[klass])
        self._peak_requested[klass] = max(self._peak_requested.get(klass, 0), self._requested[klass])
        self.in_use_bytes += _nbytes(base)
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return view

    def _drop(self, entry: _Entry, readers_stream) -> None:
        """Give a free, unreferenced buffer back to the allocator: first the stream it was allocated on waits on
        its last readers (and, for one referenced when given back, on the readers' stream now)."""
        events = entry.events + ([streams.record(readers_stream)] if entry.referenced else [])
        streams.wait(events, entry.alloc_stream)
        self.owned_bytes -= _nbytes(entry.base)
        self.frees += 1
        entry.base, entry.events, entry.views = None, [], {}

    # ------------------------------------------------------------------------------------------ hand out
    def acquire(self, numel: int, dtype: torch.dtype, device, readers_stream=None) -> Tuple[torch.Tensor, list]:
        """A free buffer of `numel` elements (a view of a buffer of up to twice that) and the events its next
        writer waits on. `readers_stream`: where readers of a buffer that was still referenced at release run (an
        event is recorded there now)."""
        klass = _class(numel, dtype, device)
        with self._lock:
            free = self._free.get(klass, [])
            fits = sorted((e.base.numel(), -i) for i, e in enumerate(free) if e.base.numel() >= numel)
            entry = None
            for _, negative in fits:
                if free[-negative].users() == 0:
                    entry = free.pop(-negative)
                    break
            if entry is not None:
                events = entry.events + ([streams.record(readers_stream)] if entry.referenced else [])
                entry.events, entry.referenced = [], False
                return self._lend(entry, numel), events
            # A miss: the class's free buffers that nobody references are all smaller than `numel`; the new one
            # serves their requests too.
            kept = []
            for other in free:
                if other.users() == 0:
                    self._drop(other, readers_stream)
                else:
                    kept.append(other)
            if free:
                self._free[klass] = kept
            largest = max([e.base.numel() for e in kept]
                          + [e.base.numel() for e, _ in self._lent.values() if e.klass == klass], default=0)
        # A new block comes from the caching allocator of the current stream, which hands out memory freed on
        # that stream at once, while kernels of its previous owner may still be queued there: the writer (another
        # stream) waits for them.
        buffer = torch.empty(max(numel, largest), dtype=dtype, device=device)
        entry = _Entry(buffer, klass, streams.current())
        with self._lock:
            self.allocations += 1
            self.owned_bytes += _nbytes(buffer)
            view = self._lend(entry, numel)
        return view, [streams.record()]

    def release(self, buffer: torch.Tensor, events: Sequence = ()) -> None:
        """Give back a buffer `acquire` handed out; `events` were recorded where its last readers (or its last
        writer) ran."""
        with self._lock:
            lent = self._lent.pop(id(buffer), None)
            if lent is None or lent[1] is not buffer:
                raise ValueError("BufferPool.release: this tensor was not handed out by the pool (or was given "
                                 "back already)")
            entry = lent[0]
            # The caller's reference to the view it gives back is not a use of the buffer.
            entry.referenced = entry.users() > 0
            entry.events = [e for e in events if e is not None]
            entry.touched = True
            klass = entry.klass
            self._count[klass] -= 1
            self._requested[klass] -= entry.requested
            self._free.setdefault(klass, []).append(entry)
            self.in_use_bytes -= _nbytes(entry.base)

    # --------------------------------------------------------------------------------------------- trim
    def trim(self, readers_stream=None) -> None:
        """Once per optimizer step, on the training thread: per class, keep the buffers in use and, of the free
        ones used during the step, the largest, up to the most in use at once during the step; free the rest.
        `readers_stream`: as for `acquire`. Sets `bound_bytes` (module docstring)."""
        with self._lock:
            referenced = 0
            for klass in list(dict.fromkeys(list(self._free) + list(self._peak_count))):
                free = self._free.get(klass, [])
                budget = self._peak_count.get(klass, 0) - self._count.get(klass, 0)
                usable = [e for e in free if e.touched and e.users() == 0]
                # The largest first; among equals the most recently given back, as `acquire` prefers them.
                ranked = sorted(reversed(usable), key=lambda e: -e.base.numel())
                keep = {id(e) for e in ranked[:max(budget, 0)]}
                kept = []
                for entry in free:
                    if id(entry) in keep:
                        kept.append(entry)
                    elif entry.users() > 0:
                        kept.append(entry)
                        referenced += _nbytes(entry.base)
                    else:
                        self._drop(entry, readers_stream)
                for entry in kept:
                    entry.touched = False
                if kept:
                    self._free[klass] = kept
                else:
                    self._free.pop(klass, None)
            self.bound_bytes = 2 * sum(self._peak_requested.values()) + referenced
            # The next step starts from what is in use now.
            self._peak_count = {k: n for k, n in self._count.items() if n}
            self._peak_requested = {k: self._requested[k] for k in self._peak_count}
            self._count = dict(self._peak_count)
            self._requested = dict(self._peak_requested)

    def clear(self) -> None:
        """Drop the free buffers (teardown); those still handed out stay counted as owned and in use."""
        with self._lock:
            self.owned_bytes -= sum(_nbytes(entry.base) for entries in self._free.values() for entry in entries)
            self._free.clear()


class StagingRing:
    """Flat send buffers for gradient buckets, used in turn. The training thread packs a bucket into the next
    slot while the reduce thread still sends the previous ones; a slot is packed again only after the job that
    sends it is done (the training thread waits for it: back-pressure when reduction falls behind compute).

    All slots have one capacity, that of the largest bucket so far: buckets of different sizes rotate over the
    slots, so per-slot sizing would keep finding a slot that never held the largest one. A larger bucket (the
    first step shows them all) waits for every slot and reallocates them together. `end_step`, once per optimizer
    step with the reduction drained, frees the slots when they are larger than the step's largest bucket; the next
    bucket reallocates them at that size (at least). So from the first bucket of a step on, each slot holds the
    largest bucket of the last step or of this one.

    Slots are freed only after the stream they were allocated on waits on the jobs that read them: the caching
    allocator hands a freed block to the next allocation on that stream at once."""

    def __init__(self, slots: int = 2):
        self._buffers = [None] * slots
        self._jobs = [None] * slots
        self._next = 0
        self._alloc_stream = None
        self._largest = 0           # elements of the largest bucket since the last `end_step`
        self._floor = 0             # the last step's largest bucket, after the slots were freed for being larger
        self.allocations = 0
        self.frees = 0

    def acquire(self, numel: int, dtype: torch.dtype, device) -> Tuple[int, torch.Tensor]:
        self._largest = max(self._largest, numel)
        first = self._buffers[0]
        if first is None or first.numel() < numel or first.dtype != dtype or first.device != torch.device(device):
            kept = first.numel() if first is not None and first.dtype == dtype else self._floor
            self._free_slots()
            self._buffers = [torch.empty(max(numel, kept), dtype=dtype, device=device) for _ in self._buffers]
            self._alloc_stream = streams.current()
            self._floor = 0
            self.allocations += len(self._buffers)
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        job = self._jobs[index]
        if job is not None:
            self._jobs[index] = None
            job.wait()
        return index, self._buffers[index].narrow(0, 0, numel)

    def _free_slots(self) -> None:
        """Wait for every slot's job, on the current stream and the slots' allocating one, and drop the slots."""
        for index, job in enumerate(self._jobs):
            if job is not None:
                self._jobs[index] = None
                job.wait(also=[s for s in (self._alloc_stream,) if s is not None])
        self.frees += sum(1 for b in self._buffers if b is not None)
        self._buffers = [None] * len(self._buffers)

    def end_step(self) -> None:
        """Once per optimizer step, on the training thread, with the reduction drained: free slots larger than the
        step's largest bucket (none in a steady loop)."""
        largest, self._largest = self._largest, 0
        if self.capacity > largest:
            self._free_slots()
            self._floor = largest

    @property
    def slots(self) -> int:
        return len(self._buffers)

    @property
    def capacity(self) -> int:
        """Elements of each slot (0 before the first bucket, and after `end_step` freed them)."""
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
