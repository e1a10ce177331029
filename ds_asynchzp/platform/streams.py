"""The device's streams and events, through DeepSpeed's accelerator: the only place the package touches them.

On a device that runs kernels asynchronously (CUDA, and any accelerator DeepSpeed does not call synchronized)
every function here works on streams and events; on a synchronized device (DeepSpeed's CPU accelerator) they
are no-ops: there, a kernel has run when its call returns. Going through the accelerator, rather than
`torch.cuda`, is also what lets a test replace the accelerator's streams with a model that checks the ordering
on CPU (`tests/stream_model.py`): DeepSpeed's own side streams come from the same accelerator.

The rules the callers follow (docs/ARCHITECTURE.md, "Ordering on the device"):
* an event is recorded on the stream where the access it stands for ran, when that access was enqueued;
* a stream that reads or writes memory another stream touched waits on that stream's event first;
* a wait on a job is always a wait on its event: a job whose host function returned has only enqueued its
  kernels.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch
from deepspeed.accelerator import get_accelerator

# Communication streams run at high priority (FSDP2 does the same), so that their copies do not starve
# behind compute kernels.
COMM_STREAM_PRIORITY = -1


def has_streams() -> bool:
    """Whether kernels run asynchronously on streams (False on DeepSpeed's CPU accelerator)."""
    return not get_accelerator().is_synchronized_device()


def new_stream(device, priority: int = COMM_STREAM_PRIORITY):
    """A new stream on `device`, or None where there are no streams. Only `scheduler.context` creates them."""
    if not has_streams():
        return None
    return get_accelerator().Stream(device=torch.device(device), priority=priority)


def current():
    """The calling thread's current stream (None where there are no streams)."""
    return get_accelerator().current_stream() if has_streams() else None


def use(stream):
    """Make `stream` current on the calling thread inside the block (nothing when `stream` is None)."""
    if stream is None:
        return contextlib.nullcontext()
    return get_accelerator().stream(stream)


def record(stream=None):
    """An event recorded now on `stream` (by default the current one): it completes once everything enqueued
    on that stream so far has run. None where there are no streams."""
    if not has_streams():
        return None
    event = get_accelerator().Event()
    event.record(stream if stream is not None else get_accelerator().current_stream())
    return event


def wait(events, stream=None) -> None:
    """Make `stream` (by default the current one) wait on each event (None entries are skipped); no host
    synchronisation."""
    if not has_streams():
        return
    if not isinstance(events, (list, tuple)):
        events = [events]
    target = stream if stream is not None else get_accelerator().current_stream()
    for event in events:
        if event is not None:
            target.wait_event(event)


def keep_alive(tensor: Optional[torch.Tensor], stream=None) -> None:
    """`tensor`'s memory, owned by the caching allocator (an autograd gradient), is not handed out again before
    `stream` (by default the current one) has run what it enqueued so far: `record_stream`, as stock ZeRO-3
    does before it drops a gradient that a side stream still reads."""
    if tensor is None or not has_streams():
        return
    tensor.record_stream(stream if stream is not None else get_accelerator().current_stream())


def synchronize(stream) -> None:
    """Block the calling thread until `stream` has run everything enqueued on it (nothing where there are no
    streams). Only for teardown: never on the critical path, never inside a communication thread."""
    if stream is not None and has_streams():
        stream.synchronize()


def key(stream):
    """What identifies `stream` on the device: the same for every Python wrapper of it (CUDA's current_stream()
    returns a new wrapper at each call). A hashable value."""
    if hasattr(stream, "stream_id") and hasattr(stream, "device_index"):
        return (stream.device_type, stream.device_index, stream.stream_id)
    return id(stream)


def distinct(streams: Iterable) -> list:
    """The streams, each once (by `key`), in order (None dropped)."""
    out, seen = [], set()
    for stream in streams:
        if stream is not None and key(stream) not in seen:
            seen.add(key(stream))
            out.append(stream)
    return out
