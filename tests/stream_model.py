"""A model of a GPU's streams, events and caching allocator, run on CPU, that checks the order of every device
access a training step makes.

On CPU with gloo every kernel has run when its call returns, so a missing stream wait never shows. This model
gives each thread a current stream, as CUDA does, and DeepSpeed's accelerator fake streams and events (so that
DeepSpeed enters its own side streams exactly where it does on a GPU), and records a happens-before relation:

* program order on each stream; an event wait orders the waiting stream after the record; a host
  synchronisation (`stream.synchronize()`, `event.synchronize()`, `.item()`, the accelerator's `synchronize`)
  orders everything the synchronising thread enqueues later after what it waited for. Host order between
  threads orders nothing: a job whose Python function returned has only enqueued its kernels. (Vector clocks,
  one entry per stream.)
* every aten op, seen through a `TorchDispatchMode` pushed on every thread that runs device work, is a kernel on
  its thread's current stream. It reads its tensor arguments and writes the ones its schema marks written (for
  the c10d collectives, whose schemas mark nothing, a table says which); a freshly allocated output is an
  allocation on that stream, and counts as a write there (even `empty`): the block may have been freed on that
  stream with kernels of its previous owner still queued.
* `current_stream()` returns a new wrapper at every call, equal to the others of its stream but not the same
  object, as CUDA's does.
* host memory: a tensor given to the accelerator's `pin_memory` (DeepSpeed pins the host optimizer's gradients
  under optimizer offload) is host memory. An op that touches only host memory runs on the host at once, not on a
  stream: it is ordered only by what its thread synchronised on, and whatever the thread enqueues afterwards comes
  after it (each thread's host is a stream of its own here). A copy between host and device memory is a kernel on
  the current stream; a blocking one (`non_blocking=False`) also synchronises the host with that stream.

It then checks, per byte range of every storage: a read comes after the write that produced its contents; a
write comes after every read and the write of the previous contents; and memory freed to the caching allocator
(the last reference to an allocation dropped) is no longer read or written by another stream, unless
`record_stream` named that stream (then the allocator waits for it, as on CUDA). Each failure is a `Violation`.

The model changes no result: every op runs as it would. Use one per process: `install()` before the engine is
built, `uninstall()` at the end.
"""

from __future__ import annotations

import bisect
import itertools
import sys
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

# c10d collectives: their schemas mark no argument as written. Index of the argument they write; the others
# are read. A collective not listed reads and writes every tensor argument.
_C10D_WRITES = {"_allgather_base_": 0, "allgather_": 0, "allgather_into_tensor_coalesced_": 0,
                "allreduce_": 0, "allreduce_coalesced_": 0, "broadcast_": 0, "_reduce_scatter_base_": 0,
                "reduce_scatter_": 0, "reduce_scatter_tensor_coalesced_": 0, "alltoall_base_": 0,
                "alltoall_": 0, "barrier": None, "monitored_barrier_": None}
# More strided pieces than this and a view is tracked as the byte span that covers it (conservative).
_MAX_PIECES = 4096
_HERE = __file__


@dataclass(frozen=True)
class Access:
    stream: int
    seq: int
    op: str
    site: str


@dataclass
class Violation:
    kind: str    # "read-after-write", "write-after-read", "write-after-write", "free-while-in-use"
    storage: str
    earlier: Access
    later: str
    streams: Dict[int, str]

    def __str__(self) -> str:
        name = self.streams.get(self.earlier.stream, self.earlier.stream)
        return (f"{self.kind} on {self.storage}: {self.later} is not ordered after {self.earlier.op} on stream "
                f"{name} (kernel {self.earlier.seq} there; {self.earlier.site})")


def _site(skip: tuple = ()) -> str:
    """The innermost frame of the package, DeepSpeed or the tests (not torch, not this model, not `skip`)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if (name != _HERE and ("ds_asynchzp" in name or "deepspeed" in name or "/tests/" in name)
                and not any(part in name for part in skip)):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def pieces(t: torch.Tensor):
    """The byte ranges of its storage that a tensor view covers, as a sorted list of [start, end)."""
    if t.numel() == 0:
        return []
    size = t.element_size()
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1 and st != 0)
    run, i = 1, 0
    while i < len(dims) and dims[i][0] == run:
        run *= dims[i][1]
        i += 1
    outer = dims[i:]
    base = t.storage_offset()
    count = 1
    for _, sz in outer:
        count *= sz
    if count > _MAX_PIECES:
        span = 1 + sum((sz - 1) * st for st, sz in dims)
        return [(base * size, (base + span) * size)]
    starts = sorted(base + sum(k * st for k, (st, _) in zip(index, outer))
                    for index in itertools.product(*(range(sz) for _, sz in outer)))
    out = []
    for start in starts:
        a, b = start * size, (start + run) * size
        if out and out[-1][1] >= a:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class _Shadow:
    """What the model knows about one storage: byte segments, each with its last write and the latest read per
    stream since then."""

    def __init__(self, storage, alloc_stream: Optional[int], label: str):
        self.ref = StorageWeakRef(storage)
        self.alloc_stream = alloc_stream
        self.label = label
        self.record_streams = set()
        self.starts: List[int] = []
        self.segments: List[list] = []      # [start, end, write Access or None, {stream: read Access}]
        self.cross_stream = False

    def split(self, a: int, b: int) -> List[list]:
        """The segments covering [a, b), split at a and b, gaps filled with fresh segments."""
        out, i, pos = [], max(0, bisect.bisect_right(self.starts, a) - 1), a
        while pos < b:
            if i < len(self.segments) and self.segments[i][1] <= pos:
                i += 1
                continue
            if i >= len(self.segments) or self.segments[i][0] >= b:
                end = b
                seg = [pos, end, None, {}]
                self.segments.insert(i, seg)
                self.starts.insert(i, pos)
            elif self.segments[i][0] > pos:
                end = self.segments[i][0]
                seg = [pos, end, None, {}]
                self.segments.insert(i, seg)
                self.starts.insert(i, pos)
            else:
                seg = self.segments[i]
                if seg[0] < pos:                # split off the part before pos
                    head = [seg[0], pos, seg[2], dict(seg[3])]
                    seg[0] = pos
                    self.segments.insert(i, head)
                    self.starts.insert(i, head[0])
                    self.starts[i + 1] = pos
                    i += 1
                if seg[1] > b:                  # split off the part after b
                    tail = [b, seg[1], seg[2], dict(seg[3])]
                    seg[1] = b
                    self.segments.insert(i + 1, tail)
                    self.starts.insert(i + 1, b)
            out.append(seg)
            pos = seg[1]
            i += 1
        return out


class FakeStream:
    def __init__(self, model: "StreamModel", name: str, priority: int = 0):
        self.model, self.name, self.priority = model, name, priority
        self.id = model._register_stream(self)
        self.clock: Dict[int, int] = {self.id: 0}
        # What identifies a CUDA stream across its Python wrappers.
        self.stream_id, self.device_index, self.device_type = self.id, 0, 1

    def __eq__(self, other) -> bool:
        return getattr(other, "stream_id", None) == self.stream_id

    def __hash__(self) -> int:
        return hash(self.stream_id)

    def wait_event(self, event) -> None:
        self.model._wait(self, event)

    def wait_stream(self, other) -> None:
        self.model._wait(self, self.model._snapshot(other))

    def record_event(self, event=None):
        event = event if event is not None else FakeEvent(self.model)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.model._host_sync(dict(self.clock))

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class _Wrapper:
    """What CUDA's `current_stream()` returns: a new Python object at every call, equal to (and hashing like) the
    other wrappers of the same stream, but not the same object. Code that keys on `id()` or compares with `is`
    breaks with it, on CUDA as here."""

    def __init__(self, stream: FakeStream):
        object.__setattr__(self, "_stream", stream)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __setattr__(self, name, value):
        setattr(self._stream, name, value)

    def __eq__(self, other) -> bool:
        return self._stream == other

    def __hash__(self) -> int:
        return hash(self._stream)

    def __repr__(self) -> str:
        return f"wrapper of {self._stream!r}"


class FakeEvent:
    def __init__(self, model: "StreamModel" = None, enable_timing=False, blocking=False, interprocess=False):
        self.model = model or StreamModel.active
        self.clock: Optional[Dict[int, int]] = None

    def record(self, stream=None) -> None:
        stream = stream if stream is not None else self.model.current()
        with self.model._lock:
            self.model._merge_host(stream)
            self.clock = dict(stream.clock)
            self.model.stats["records"] += 1

    def wait(self, stream=None) -> None:
        (stream if stream is not None else self.model.current()).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if self.clock is not None:
            self.model._host_sync(self.clock)

    def elapsed_time(self, other) -> float:
        return 0.0


class _Mode(TorchDispatchMode):
    def __init__(self, model: "StreamModel"):
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.model._kernel(func, args, kwargs, result)
        return result


class _StreamContext:
    def __init__(self, model: "StreamModel", stream):
        self.model, self.stream = model, stream

    def __enter__(self):
        self.model._push(self.stream)
        return self.stream

    def __exit__(self, *exc):
        self.model._pop()
        return False


class StreamModel:
    """See the module docstring. `violations` lists what the checks found, `stats` what was modelled."""

    active: Optional["StreamModel"] = None

    def __init__(self):
        self._lock = threading.RLock()
        self._local = threading.local()
        self._streams: Dict[int, FakeStream] = {}
        self._host: Dict[int, Dict[int, int]] = {}      # thread id -> clock it synchronised on
        self._shadows: Dict[int, _Shadow] = {}          # storage base address -> shadow
        self._watched: Dict[int, _Shadow] = {}          # shadows touched by a stream other than their allocator's
        self._seen = 0
        self.violations: List[Violation] = []
        self._reported = set()
        self.stats = {"kernels": 0, "records": 0, "waits": 0, "frees_checked": 0, "host_syncs": 0, "host_ops": 0}
        self.default = FakeStream(self, "default (compute)")
        self._schemas = {}
        self._saved = None

    # ------------------------------------------------------------------------------ streams, events
    def _register_stream(self, stream) -> int:
        with self._lock:
            stream_id = len(self._streams) + 1
            self._streams[stream_id] = stream
            return stream_id

    def new_stream(self, device=None, priority: int = 0, **_) -> FakeStream:
        """Named after where it was made (the package's streams module and the accelerator skipped), so that a
        violation says whose stream it is; the first thread other than the main one to enter it is added."""
        site = _site(skip=("platform/streams.py", "accelerator/"))
        with self._lock:
            return FakeStream(self, f"s{len(self._streams) + 1} made at {site}", priority)

    def current(self) -> "_Wrapper":
        """The calling thread's current stream, as a new wrapper (see `_Wrapper`)."""
        stack = getattr(self._local, "stack", None)
        return _Wrapper(stack[-1] if stack else self.default)

    @staticmethod
    def _unwrap(stream):
        return stream._stream if isinstance(stream, _Wrapper) else stream

    def _push(self, stream) -> None:
        local = self._local
        if not hasattr(local, "stack"):
            local.stack, local.modes = [], []
        stream = self._unwrap(stream if stream is not None else self.current())
        local.stack.append(stream)
        thread = threading.current_thread()
        if thread is not threading.main_thread() and not getattr(stream, "thread_named", False):
            stream.thread_named = True
            stream.name += f", used by thread {thread.name}"
        if not getattr(local, "mode_on", False):
            # The first stream entered on a thread without the mode (a communication thread) turns it on there.
            mode = _Mode(self)
            mode.__enter__()
            local.modes.append(mode)
            local.mode_on = True
        else:
            local.modes.append(None)

    def _pop(self) -> None:
        local = self._local
        local.stack.pop()
        mode = local.modes.pop()
        if mode is not None:
            mode.__exit__(None, None, None)
            local.mode_on = False

    def _snapshot(self, stream) -> FakeEvent:
        event = FakeEvent(self)
        event.record(stream)
        return event

    def _wait(self, stream, event) -> None:
        if event is None or event.clock is None:
            return   # an event never recorded: CUDA treats a wait on it as satisfied
        with self._lock:
            self._merge_host(stream)
            for key, value in event.clock.items():
                if stream.clock.get(key, 0) < value:
                    stream.clock[key] = value
            self.stats["waits"] += 1

    def _host_sync(self, clock: Dict[int, int]) -> None:
        with self._lock:
            host = self._host.setdefault(threading.get_ident(), {})
            for key, value in clock.items():
                if host.get(key, 0) < value:
                    host[key] = value
            self.stats["host_syncs"] += 1

    def device_synchronize(self, device_index=None) -> None:
        with self._lock:
            for stream in list(self._streams.values()):
                self._host_sync(dict(stream.clock))

    def _merge_host(self, stream) -> None:
        """Work a thread enqueues after a host synchronisation comes after what it synchronised on."""
        host = self._host.get(threading.get_ident())
        if host:
            for key, value in host.items():
                if stream.clock.get(key, 0) < value:
                    stream.clock[key] = value

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        if tensor.numel() == 0 and tensor.untyped_storage().nbytes() == 0:
            return
        with self._lock:
            shadow = self._shadow_of(tensor, create=True, alloc_stream=None)
            shadow.record_streams.add(stream.id)

    # ---------------------------------------------------------------------------------- kernels
    def _schema(self, func):
        cached = self._schemas.get(func)
        if cached is None:
            schema = func._schema
            namespace = schema.name.split("::")[0]
            base = func.__name__.split(".")[0] if hasattr(func, "__name__") else schema.name
            base = schema.name.split("::")[-1]
            args = []
            if namespace == "c10d":
                written = _C10D_WRITES.get(base, "all")
                for index, argument in enumerate(schema.arguments):
                    writes = written == "all" or written == index
                    reads = written == "all" or written != index
                    args.append((argument.name, reads, writes))
                returns_alias = True
            else:
                for argument in schema.arguments:
                    writes = argument.alias_info is not None and argument.alias_info.is_write
                    args.append((argument.name, not writes, writes))
                returns_alias = all(r.alias_info is not None for r in schema.returns)
            view_only = not any(w for _, _, w in args) and schema.returns and returns_alias
            cached = self._schemas[func] = (args, view_only, f"{namespace}::{base}")
        return cached

    def register_host(self, tensor: torch.Tensor) -> None:
        """`tensor`'s storage is host memory (pinned): pinning copies it into new host memory, written by the
        calling thread's host."""
        if tensor.untyped_storage().nbytes() == 0:
            return
        with self._lock:
            shadow = self._shadow_of(tensor, create=True, alloc_stream=None)
            shadow.host, shadow.alloc_stream, shadow.segments, shadow.starts = True, None, [], []
            host = self._host_stream()
            self._merge_host(host)
            host.clock[host.id] += 1
            self._access(tensor, host, Access(host.id, host.clock[host.id], "pin_memory", _site()), write=True)
            self._host_sync({host.id: host.clock[host.id]})

    def _is_host(self, tensor: torch.Tensor) -> bool:
        if tensor.untyped_storage().nbytes() == 0:
            return False
        shadow = self._shadow_of(tensor, create=False, alloc_stream=None)
        return shadow is not None and getattr(shadow, "host", False)

    def _host_stream(self) -> FakeStream:
        """The calling thread's host, as a stream: its ops run in program order, after what the thread
        synchronised on."""
        stream = getattr(self._local, "host_stream", None)
        if stream is None:
            stream = self._local.host_stream = FakeStream(self, f"host of thread {threading.current_thread().name}")
        return stream

    def _kernel(self, func, args, kwargs, result) -> None:
        spec, view_only, name = self._schema(func)
        if view_only:
            return
        with self._lock:
            reads, writes = [], []
            for index, (arg_name, reads_it, writes_it) in enumerate(spec):
                value = args[index] if index < len(args) else kwargs.get(arg_name)
                for tensor in _tensors(value):
                    if writes_it:
                        writes.append(tensor)
                    if reads_it:
                        reads.append(tensor)
            touched = [self._is_host(t) for t in reads + writes]
            # A 0-dim operand beside host memory is a host scalar (a CUDA one would not mix with host memory).
            on_host = any(touched) and all(h or t.dim() == 0 for h, t in zip(touched, reads + writes))
            stream = self._host_stream() if on_host else self.current()
            self._merge_host(stream)
            stream.clock[stream.id] += 1
            access = Access(stream.id, stream.clock[stream.id], name, _site())
            self.stats["host_ops" if on_host else "kernels"] += 1
            self._check_frees()
            inputs = {id(t) for t in reads + writes}
            if on_host:
                # Its 0-dim operands outside host memory are host scalars (on a GPU, CPU tensors such as the norm
                # stock's offload path brings to the host); the model does not follow them.
                reads = [t for t in reads if self._is_host(t)]
                writes = [t for t in writes if self._is_host(t)]
            for tensor in reads:
                self._access(tensor, stream, access, write=False)
            for tensor in writes:
                self._access(tensor, stream, access, write=True)
            for tensor in _tensors(result):
                if id(tensor) in inputs:
                    continue
                fresh = self._fresh(tensor, None if on_host else stream)
                if fresh and on_host:
                    # Host memory of the host's op (not the caching allocator's): written there, never "freed".
                    self._shadow_of(tensor, create=False, alloc_stream=None).host = True
                if fresh:
                    # An allocation counts as a write on the allocating stream even where it writes nothing
                    # (`empty`): the caching allocator hands out a block freed on that stream at once, while
                    # kernels of its previous owner may still be queued there, so a writer on another stream must
                    # wait on an event recorded after the allocation.
                    self._access(tensor, stream, access, write=True)
            if isinstance(result, (bool, int, float)) and not isinstance(result, torch.Tensor):
                self._host_sync(dict(stream.clock))     # .item(), .equal(): the host waited for the stream
            elif on_host:
                self._host_sync({stream.id: stream.clock[stream.id]})   # later work of the thread comes after it
            elif any(touched) and name == "aten::copy_" and not _non_blocking(args, kwargs):
                self._host_sync(dict(stream.clock))     # a blocking copy to or from the host waits for the stream
            self._seen += 1
            if self._seen % 2000 == 0:
                self._sweep()

    def _shadow_of(self, tensor: torch.Tensor, create: bool, alloc_stream: Optional[int]) -> Optional[_Shadow]:
        storage = tensor.untyped_storage()
        base = storage.data_ptr()
        shadow = self._shadows.get(base)
        if shadow is not None and shadow.ref.expired():
            self._freed(shadow)
            shadow = None
        if shadow is None and create:
            shadow = _Shadow(storage, alloc_stream, f"{tuple(tensor.shape)} {str(tensor.dtype)[6:]} "
                                                    f"storage allocated at {_site()}")
            self._shadows[base] = shadow
        return shadow

    def _fresh(self, tensor: torch.Tensor, stream) -> bool:
        if tensor.untyped_storage().nbytes() == 0:
            return False
        existing = self._shadows.get(tensor.untyped_storage().data_ptr())
        if existing is not None and not existing.ref.expired():
            return False
        self._shadow_of(tensor, create=True, alloc_stream=stream.id if stream is not None else None)
        return True

    def _access(self, tensor: torch.Tensor, stream, access: Access, write: bool) -> None:
        if tensor.untyped_storage().nbytes() == 0:
            return
        shadow = self._shadow_of(tensor, create=True, alloc_stream=None)
        clock = stream.clock
        for a, b in pieces(tensor):
            for seg in shadow.split(a, b):
                last = seg[2]
                if last is not None and last.stream != stream.id and clock.get(last.stream, 0) < last.seq:
                    self._report("write-after-write" if write else "read-after-write", shadow, last, access)
                if write:
                    for read in seg[3].values():
                        if read.stream != stream.id and clock.get(read.stream, 0) < read.seq:
                            self._report("write-after-read", shadow, read, access)
                    seg[2], seg[3] = access, {}
                else:
                    seg[3][stream.id] = access
        if shadow.alloc_stream is not None and stream.id != shadow.alloc_stream and not shadow.cross_stream:
            shadow.cross_stream = True
            self._watched[id(shadow)] = shadow

    # ------------------------------------------------------------------------------- the allocator
    def _check_frees(self) -> None:
        for key, shadow in list(self._watched.items()):
            if shadow.ref.expired():
                del self._watched[key]
                self._freed(shadow)

    def _freed(self, shadow: _Shadow) -> None:
        """The last reference went: the caching allocator may hand the memory to the next allocation on the
        stream that allocated it, at once. Every access by another stream must be ordered before this point,
        unless `record_stream` named that stream."""
        if shadow.alloc_stream is None or getattr(shadow, "checked", False):
            return
        shadow.checked = True
        self.stats["frees_checked"] += 1
        owner = self._streams[shadow.alloc_stream]
        later = f"the allocator's reuse on stream {owner.name} (freed at {_site()})"
        # What the host had waited for when it dropped the memory has finished (the frees are seen at the next
        # model entry, on the thread that made them in practice).
        host = self._host.get(threading.get_ident(), {})
        for seg in shadow.segments:
            for earlier in ([seg[2]] if seg[2] is not None else []) + list(seg[3].values()):
                if earlier.stream == owner.id or earlier.stream in shadow.record_streams:
                    continue
                if owner.clock.get(earlier.stream, 0) < earlier.seq and host.get(earlier.stream, 0) < earlier.seq:
                    self._report("free-while-in-use", shadow, earlier, later)

    def _sweep(self) -> None:
        for base, shadow in list(self._shadows.items()):
            if shadow.ref.expired():
                if id(shadow) in self._watched:
                    del self._watched[id(shadow)]
                    self._freed(shadow)
                del self._shadows[base]

    def _report(self, kind: str, shadow: _Shadow, earlier: Access, later) -> None:
        if not isinstance(later, str):
            stream = self._streams[later.stream]
            later = (f"{later.op} on stream {stream.name} ({later.site}; it has waited for kernel "
                     f"{stream.clock.get(earlier.stream, 0)} of stream {self._streams[earlier.stream].name})")
        key = (kind, earlier.site, later.split(" (")[0] if " (" in later else later, shadow.label)
        if key in self._reported:
            return
        self._reported.add(key)
        self.violations.append(Violation(kind, shadow.label, earlier, later,
                                         {i: s.name for i, s in self._streams.items()}))

    def finish(self) -> List[Violation]:
        """Check the frees not yet seen; the violations so far."""
        with self._lock:
            self._check_frees()
        return self.violations

    # ------------------------------------------------------------------------------ installation
    def install(self) -> "StreamModel":
        """Give DeepSpeed's accelerator this model's streams and events, route `Tensor.record_stream` here, and
        turn the op recording on for the calling (training) thread."""
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        model = self
        base = type(accelerator)

        class ModelledAccelerator(base):
            def is_synchronized_device(self):
                return False

            def resolves_data_dependency(self):
                return False

            def handles_memory_backpressure(self):
                return False

            def is_fp16_supported(self):    # a GPU's; torch runs fp16 on CPU, slowly
                return True

            @property
            def Stream(self):   # noqa: N802 - the accelerator's own name
                return model.new_stream

            def stream(self, stream):
                return _StreamContext(model, stream)

            def current_stream(self, device_index=None):
                return model.current()

            def default_stream(self, device_index=None):
                return _Wrapper(model.default)

            @property
            def Event(self):    # noqa: N802
                return lambda **kw: FakeEvent(model, **kw)

            def synchronize(self, device_index=None):
                model.device_synchronize()

            def pin_memory(self, tensor, align_bytes=1):
                model.register_host(tensor)
                return tensor

        self._saved = (accelerator, base, torch.Tensor.record_stream)
        accelerator.__class__ = ModelledAccelerator
        torch.Tensor.record_stream = lambda tensor, stream: model.record_stream(tensor, stream)
        StreamModel.active = self
        self._training_mode = _Mode(self)
        self._training_mode.__enter__()
        self._local.mode_on = True
        return self

    def uninstall(self) -> None:
        if self._saved is None:
            return
        accelerator, base, record_stream = self._saved
        self._training_mode.__exit__(None, None, None)
        self._local.mode_on = False
        accelerator.__class__ = base
        torch.Tensor.record_stream = record_stream
        StreamModel.active = None
        self._saved = None


def _non_blocking(args, kwargs) -> bool:
    return bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
