"""Rank-side code of the stream-model tests: train cases with DeepSpeed's accelerator replaced by the stream model
(`tests/stream_model.py`), optionally with one of the device-ordering fixes taken out (`planted`), and report
what the model found.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time

import deepspeed

from tests._dist_workers import WORLD_TIMEOUT_S, _build_engine, edit_a_weight, train_step
from tests.stream_model import StreamModel

# DeepSpeed's throughput timer synchronises the device at every forward and step from the third step on, which
# hides races across a step boundary; GPU users turn it off to overlap, and so does the model.
UNSYNCHRONIZED_TIMERS = {"timers": {"throughput": {"enabled": True, "synchronized": False}}}


@contextlib.contextmanager
def planted(fault):
    """Take out one of the waits that order the device (the fixes of the CUDA-ordering findings), to show that
    the model reports its absence."""
    from ds_asynchzp.comm.step_boundary import StepBoundary
    from ds_asynchzp.platform import streams
    from ds_asynchzp.runtime.optimizer import HierarchicalZeroOptimizer
    from ds_asynchzp.state.buffer_pool import BufferPool
    from ds_asynchzp.state.sharded_buffer import ShardedBuffer

    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if fault == "release_events":
        # 1: a gathered parameter's buffer goes back to the pool with no event of its last readers.
        release = BufferPool.release

        def release_without_events(self, buffer, events=()):
            release(self, buffer, [])
            for entries in self._free.values():
                for entry in entries:
                    if entry.base.data_ptr() == buffer.data_ptr():
                        entry.referenced = False
        patch(BufferPool, "release", release_without_events)
    elif fault == "grad_keep_alive":
        # 2: the gradient autograd made is dropped without record_stream.
        patch(streams, "keep_alive", lambda tensor, stream=None: None)
    elif fault == "host_done":
        # 3: a refresh job done on the host is taken as done on the device (no event wait).
        refresh_waits = StepBoundary.refresh_waits

        class HostOnly:
            def __init__(self, job):
                self.job = job

            def wait(self, also=()):
                return self.job.wait_host()
        patch(StepBoundary, "refresh_waits", lambda self, params: [HostOnly(j) for j in refresh_waits(self, params)])
    elif fault == "host_writes":
        # 4: the training thread's writes into the shards (the step's, a load's) record nothing.
        patch(ShardedBuffer, "host_events", lambda self: [])
    elif fault == "pool_miss_event":
        # A new pool buffer, allocated on the current stream, written by the gather stream with no event.
        acquire = BufferPool.acquire

        def acquire_without_allocation_event(self, numel, dtype, device, readers_stream=None):
            misses = self.allocations
            buffer, events = acquire(self, numel, dtype, device, readers_stream)
            return buffer, ([] if self.allocations > misses else events)
        patch(BufferPool, "acquire", acquire_without_allocation_event)
    elif fault == "overflow_order":
        # 5: the fp16 overflow check's side stream is not ordered after our gradient writes.
        patch(HierarchicalZeroOptimizer, "_hzp_order_overflow_check", lambda self: None)
    elif fault == "copy_before_sum":
        # 6: optimizer offload: a chunk's copy to the host does not wait for the chunk's cross-node sum.
        from ds_asynchzp.comm.host_copy import GradToHost
        patch(GradToHost, "_after", lambda self, summed: None)
    elif fault == "refresh_before_h2d":
        # 7: optimizer offload: a stepped sub-group's refresh does not wait for its host-to-device copy.
        from ds_asynchzp.state.param_shards import ParamShards

        def zero_padding_unrecorded(self, buffer, start, end):
            for owner, column, _, view in self._padding:
                if owner is buffer and start <= column < end:
                    view.zero_()
        patch(ParamShards, "zero_padding_in", zero_padding_unrecorded)
    elif fault == "refresh_before_copy_back":
        # 9: the host step in pieces: the buffer does not note a piece's copy back, so its refresh does not wait.
        from ds_asynchzp.comm.host_copy import ParamsToDevice
        from ds_asynchzp.state.sharded_buffer import ShardedBuffer as Buffer

        copy = ParamsToDevice.copy

        def copy_unnoted(self, master, buffer, start, zeroed):
            note, buffer.note_host_access = buffer.note_host_access, lambda: None
            try:
                copy(self, master, buffer, start, zeroed)
            finally:
                del buffer.note_host_access
        patch(ParamsToDevice, "copy", copy_unnoted)
    elif fault == "host_step_before_copy_out":
        # 10: the host step in pieces: the host does not block on the copies to the host of a piece's chunks.
        from ds_asynchzp.comm.host_copy import GradToHost
        patch(GradToHost, "host_wait_chunks", lambda self, indices: None)
    elif fault == "reopen_own_family_only":
        # 8: optimizer offload with several families (AutoEP): a reopened window copies and takes the norms of every
        # family's gradients having waited for its own family's cross-node sums alone.
        def reopen_waiting_for_its_own_family(self, placement):
            placement.reduce.drain()
            placement.boundary.end_window()
            self.hzp_offload.finish_window()
            placement.grads.reopen()
        patch(HierarchicalZeroOptimizer, "_hzp_reopen_window", reopen_waiting_for_its_own_family)
    elif fault:
        raise ValueError(f"unknown planted fault {fault!r}")
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _train(case: dict) -> list:
    from deepspeed.accelerator import get_accelerator

    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    engine = _build_engine(dict(case, ds_extra=dict(UNSYNCHRONIZED_TIMERS, **case.get("ds_extra", {}))))
    losses = []
    # A user who trains on a stream of their own: compute is then not the default stream.
    user_stream = get_accelerator().Stream() if case.get("user_stream") else None
    for step in range(case["steps"]):
        if step == case.get("modify_at"):
            edit_a_weight(engine, rank)
        if user_stream is not None:
            with get_accelerator().stream(user_stream):
                losses.append(train_step(engine, case, step, rank, world))
        else:
            losses.append(train_step(engine, case, step, rank, world))
    engine.destroy()
    return losses


@contextlib.contextmanager
def _fp16_on_this_cpu():
    """DeepSpeed's CPU accelerator allows fp16 only where oneDNN has fp16 kernels (CPUs with AVX512-FP16 or AMX);
    torch computes fp16 on any CPU, slowly. The runs without the model claim it as the model's accelerator does, so
    that both sides of a comparison run on every machine."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    base = type(accelerator)
    accelerator.__class__ = type("Fp16Accelerator", (base,), {"is_fp16_supported": lambda self: True})
    try:
        yield
    finally:
        accelerator.__class__ = base


def run_model_cases(payload: dict) -> dict:
    from ds_asynchzp.runtime import host_step_pipeline

    # The tiny model's sub-groups are far below the host step's piece floor: pieces as small as the chunks, so that
    # the offload cases step several and their copies back reuse the staging slots.
    host_step_pipeline.MIN_PIECE_ELEMENTS = 64
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=WORLD_TIMEOUT_S))
    results = {}
    for case in payload["cases"]:
        started = time.perf_counter()
        if case.get("no_model"):
            with _fp16_on_this_cpu():
                losses = _train(case)
            results[case["name"]] = {"losses": losses, "violations": [], "kinds": [], "stats": None}
            print(f"case {case['name']} (no model): {time.perf_counter() - started:.1f} s", flush=True)
            continue
        model = StreamModel().install()
        try:
            with planted(case.get("plant")):
                losses = _train(case)
        finally:
            violations = model.finish()
            model.uninstall()
        results[case["name"]] = {"losses": losses, "violations": [str(v) for v in violations],
                                 "kinds": sorted({v.kind for v in violations}), "stats": dict(model.stats)}
        print(f"case {case['name']}: {len(violations)} violations, {model.stats['kernels']} kernels, "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        for violation in violations[:20]:
            print(f"  {violation}", flush=True)
    results["rank"] = int(os.environ["RANK"])
    deepspeed.comm.barrier()
    return results
