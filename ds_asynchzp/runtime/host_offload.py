"""Optimizer states on the host (`zero_optimization.offload_optimizer: {"device": "cpu"}`): which gradients go to
the host, when, and what crosses between device and host.

Stock ZeRO-3 with offload keeps its gradient partitions in host memory: at every micro-step each reduced
partition goes to the host and back to the device to be accumulated, so its host-device traffic grows with
gradient accumulation. Here the gradient shard stays on the device, and host-device traffic is once per optimizer
step, pipelined with the step boundary:

* sum -> device-to-host: each chunk job of the window's cross-node sum (`StepBoundary`) copies the chunk's summed
  columns of the parameters stock would copy into the host optimizer's fp32 gradients, on the boundary's copy
  stream, while the next chunk is exchanged (`comm.host_copy.GradToHost`);
* norm: once the window is summed, the per-parameter norms stock's offload path clips with are taken from the own
  atoms on the device (Stage 3's own function, in its order);
* host step -> host-to-device -> refresh: Stage 3's step runs DeepSpeedCPUAdam sub-group by sub-group, unchanged,
  and copies each stepped sub-group into the own row of the parameter shard; the refresh of that sub-group's
  chunks is submitted at once (`StepBoundary.refresh_through`), so it runs while the host steps the next one.

Which gradients are copied follows stock's offload semantics, which differ from the path without offload. Stock
copies at the boundary only the parameters reduced in the window's last backward (managed accumulation: its
`partition_grads` copies when the engine says the backward ends the window), or, with unmanaged accumulation,
every parameter reduced since the last step (`finalize_gradient_accumulation_boundary`). A parameter outside that
set keeps on the host the fp32 gradient of the last time it was copied (it steps with it again) and counts in no
norm. Copying after the chunk's sum rather than during the last backward gives the same values: the own atom of a
parameter reduced in that backward holds the window's sum. A later backward reopens the window: what was marked is
copied and its norm taken first, once every family's cross-node sums have ended (the marked parameters span the
families), with the values stock copied, and a later boundary backward marks what it reaches again. A parameter marked only after its chunks were submitted (the unmanaged boundary, when the engine already
ended the window at its backward) is copied when the window is waited for, on the training thread.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable

from ..platform import ledger
from ..comm.host_copy import GradToHost
from ..platform import streams
from ..platform.deepspeed_internals import (offload_grad_norm, offload_grad_norms, offload_host_grad,
                                            offload_reduced_since_step, stage3_sub_groups)


class HostOffload:
    """The parameters whose summed gradient goes to the host in this window, the chunk copies, and the norms."""

    def __init__(self, optimizer, placement_of: Callable, copy_stream):
        self.optimizer = optimizer
        self.placement_of = placement_of      # ds_id -> the parameter's Placement (its shards and boundary)
        self.copy_stream = copy_stream
        self.pending: set = set()             # ds_ids stock would copy at this window's boundary
        self._copied: Dict[int, set] = {}     # ds_id -> chunk indices whose job copies it, this window
        self._params: Dict[int, object] = {}  # ds_id -> parameter
        self._copies: Dict[int, GradToHost] = {}   # id(placement) -> its copier
        self._copied_event = None             # on the current stream after the window's copies (None: no streams)
        self._norms_on_side_stream = False    # norms taken in a reopened window, inside DeepSpeed's backward hook

    def copier(self, placement) -> Callable:
        """The `after_sum` of a placement's `StepBoundary`."""
        copy = self._copies[id(placement)] = GradToHost(placement.grads.buffer, self.copy_stream)

        def after_sum(index: int, start: int, end: int, members: Iterable[int]):
            columns = placement.grads.buffer.columns
            segments = []
            for ds_id in sorted((m for m in members if m in self.pending), key=lambda m: columns[m].offset):
                c = columns[ds_id]
                lo, hi = max(start, c.offset), min(end, c.offset + c.atom)
                host = offload_host_grad(self.optimizer, self._params[ds_id]).narrow(0, lo - c.offset, hi - lo)
                segments.append((lo, hi, host))
                self._copied.setdefault(ds_id, set()).add(index)
            return copy.after_sum(index, segments)

        return after_sum

    def reduced(self, params: Iterable, at_boundary: bool) -> None:
        """A bucket of these parameters was reduced; in the window's last backward stock copies them."""
        if at_boundary:
            for param in params:
                self.pending.add(param.ds_id)
                self._params[param.ds_id] = param

    def unmanaged_boundary(self) -> None:
        """`step()` ends the window under unmanaged accumulation: stock copies every parameter reduced since the
        last step."""
        marked = offload_reduced_since_step(self.optimizer)
        for group in stage3_sub_groups(self.optimizer):
            for param in group:
                if param.ds_id in marked:
                    self.pending.add(param.ds_id)
                    self._params[param.ds_id] = param

    def finish_window(self, on_side_stream: bool = False, copies_may_run: bool = False) -> None:
        """The window's chunk jobs are done: any parameter marked after its chunks were submitted is copied now
        (after the chunk copies), and the norms of the copied gradients are recorded (Stage 3's order of
        parameters). The host reads the gradients after `host_wait` or `host_wait_columns`; the chunk copies may
        still run meanwhile (the norms read the device's rows, as they do). `on_side_stream`: called in a reopened
        window, where the current stream is the side stream of DeepSpeed's backward hook. `copies_may_run`: the
        step's own call, after which nothing writes the own rows before the window ends (`end_window`); elsewhere
        (a reader outside the step, a reopened window that zeroes the rows next) the current stream waits for the
        copies here."""
        if not copies_may_run:
            self.wait_copies()
        if self._norms_on_side_stream and not on_side_stream:
            # Norms allocated on the hook's side stream are read by the step on this stream and freed after it:
            # their memory must not go back to the side stream before those reads (as stock's record_stream).
            for norm in offload_grad_norms(self.optimizer):
                streams.keep_alive(norm)
            self._norms_on_side_stream = False
        self._norms_on_side_stream |= on_side_stream and bool(self.pending)
        if not self.pending:
            self._copied.clear()
            return
        late = 0
        for group in stage3_sub_groups(self.optimizer):
            for param in group:
                if param.ds_id not in self.pending:
                    continue
                placement = self.placement_of(param.ds_id)
                atom = placement.grads.buffer.own_atom(param)
                if not set(placement.boundary.grad_chunks_of(param.ds_id)) <= self._copied.get(param.ds_id, set()):
                    if not late:
                        self.wait_copies()   # a chunk copy of this parameter may be writing the same host elements
                    host = offload_host_grad(self.optimizer, param)
                    host.copy_(atom.to(host.dtype), non_blocking=True)
                    late += host.numel() * host.element_size()
                offload_grad_norm(self.optimizer, param, atom)
        self.pending.clear()
        self._copied.clear()
        self._params.clear()
        if late:
            ledger.note_host_copy("to_host", late)
        self._copied_event = streams.record()

    def host_wait(self) -> None:
        """Block until the window's copies to the host have ended, before the host reads them (DeepSpeedCPUAdam,
        the gradient accessors)."""
        self._host_wait_late()
        for copy in self._copies.values():
            copy.host_wait()

    def host_wait_columns(self, placement, start: int, end: int) -> None:
        """Block until the copies of the gradient columns [start, end) of `placement` have ended (and any copy made
        on the training thread), before the host step of those columns reads them."""
        self._host_wait_late()
        copy = self._copies.get(id(placement))
        if copy is not None:
            copy.host_wait_chunks(placement.boundary.grad_chunks_in(start, end))

    def _host_wait_late(self) -> None:
        if self._copied_event is not None:
            self._copied_event.synchronize()
            self._copied_event = None

    def end_window(self) -> None:
        """The step is over: the current stream waits for the window's copies before the next window rewrites the
        rows they read."""
        self.wait_copies()

    def wait_copies(self) -> None:
        """The current stream waits for the copies submitted so far (they read the gradient shard's own row, which
        the next window rewrites)."""
        for copy in self._copies.values():
            copy.wait()

    @staticmethod
    def stepped_to_device(nbytes: int) -> None:
        """Stage 3 copied a stepped sub-group from the host master weights into the parameter shard."""
        ledger.note_host_copy("to_device", nbytes)


__all__ = ["HostOffload"]
