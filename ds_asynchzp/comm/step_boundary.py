"""Once per optimizer step, the only traffic that crosses nodes: the gradient sum and the parameter refresh.

Both walk their buffer in column chunks of at most one bucket, each chunk one job of the `boundary` thread, so
the transient memory is one bucket and the cross-node hop overlaps compute:

* Gradients: the T_g = d_o / d_g ranks {h*d_o + k*d_g + i : k} each hold row k' of the others' atoms; member
  k receives row k from every member and sums them in fp32 into its own atom. Each rank sends only the sums
  the others own, once, in the communication dtype. gloo's reduce-scatter is an all-reduce underneath (twice
  the bytes), so on gloo this is a pairwise exchange (all-to-all); elsewhere the backend's reduce-scatter.
  With d_o < N the N / d_o optimizer replicas then all-reduce the own atoms. In a window reopened by a late
  gradient (`GradShards.reopen`), the sum of the window before the reopening is then added to the own atoms.
  During the last backward of a window, a chunk is submitted as soon as every parameter in it has had its
  bucket submitted for reduction (`grads_complete`); its job first waits for those reductions. The rest are
  submitted when the backward ends (`submit_remaining`), and whoever reads a gradient waits (`wait_grads`).
* Parameters: after the optimizer step each rank's own atoms are updated; the T_p = d_o / d_p ranks
  {h*d_o + t*d_p + j : t} all-gather them, which rebuilds row t of every member's parameter shard. The chunks
  are submitted in column order, which is the order the forward first uses them, and a gather reading a
  parameter waits only for the chunks that hold it (`refresh_waits`).

Every rank submits the same chunks in the same order: a chunk's readiness depends only on which buckets were
submitted, never on when a reduction finished.

Ordering on the device: a chunk job's stream waits on the buffer's host events (the training thread's zeroing
and the optimizer's step) and on the jobs it depends on, by their events. A buffer's latest refresh is kept
until the next one replaces it, and a gather waits on its jobs' events even when they are done on the host:
the host function returning means only that the kernels are enqueued.

Quantized (`ds_asynchzp.quantization`: `quantize_cross_node`, `quantized_gradients`): the gradient exchange
sends each row block-quantized and sums the dequantized rows in fp32 (optionally with error feedback: each
rank adds to every row it sends what the quantization dropped from that row the step before); the replica
all-reduce runs as a quantized reduce-scatter plus all-gather; the refresh sends the updated own atoms in INT8
and writes the dequantized values into the other rows (the own row stays exact).
"""

from __future__ import annotations

import bisect
from typing import Callable, Dict, Iterable, List, Optional

import torch

from ..platform import ledger
from ..platform import streams
from ..quantization import NO_QUANTIZATION, QuantizationPlan
from ..platform.process_groups import ProcessGroups
from ..state.error_feedback import ErrorFeedback
from ..state.scratch import Scratch
from ..state.grad_shards import GradShards, Window
from ..state.sharded_buffer import ShardedBuffer
from . import quantized
from .collectives import all_gather, all_reduce, all_to_all, backend_reduce_scatter_is_optimal, reduce_scatter


# DeepSpeed's default reduce_bucket_size (5e8 elements) would make most models' whole shard one chunk, whose
# exchange could start only once the last backward has ended. Chunks of at most 8 Mi elements (16 MB in bf16,
# near DDP's 25 MB buckets) let it start during the backward.
DEFAULT_MAX_BUCKET_ELEMENTS = 1 << 23
# A pipeline needs stages: a buffer is cut into at least this many chunks by default, so that the exchange
# follows the backward closely and the tail after it is short. On the emulated 2 x 4 cluster at 100 Mbit/s,
# chunks of 1/32 of the shard left a shorter shaped step than chunks of 1/7, at the same unshaped step
# (docs/benchmarks: the chunk sweep, and 3 % over 16 steps side by side; single runs vary by more).
# Buffers of 2^28 elements or more are cut by the cap above instead.
DEFAULT_MIN_CHUNKS = 32
# ...but no chunk below 64 Ki elements (128 KB in bf16), where a collective's fixed cost would dominate.
MIN_DEFAULT_BUCKET_ELEMENTS = 1 << 16


def bucket_elements(configured: Optional[int], reduce_bucket_size, buffer_elements: Optional[int] = None) -> int:
    """Elements per chunk of a buffer of `buffer_elements`: `async_hzp.boundary_bucket_size` if set, else
    reduce_bucket_size up to the cap, and small enough for DEFAULT_MIN_CHUNKS chunks (not below the floor)."""
    if configured:
        return int(configured)
    elements = min(int(reduce_bucket_size), DEFAULT_MAX_BUCKET_ELEMENTS)
    if buffer_elements:
        elements = min(elements, max(MIN_DEFAULT_BUCKET_ELEMENTS, -(-int(buffer_elements) // DEFAULT_MIN_CHUNKS)))
    return max(1, elements)


class _Chunks:
    """The column chunks of one buffer, which chunks a parameter's columns fall in, and how each chunk is cut
    into parameters (the segments a quantized flow restarts its blocks at)."""

    def __init__(self, buffer: ShardedBuffer, bucket_elements: int):
        self.ranges = list(buffer.column_chunks(bucket_elements))
        self.starts = [start for start, _ in self.ranges]
        self.of_param: Dict[int, List[int]] = {}
        self.members: List[set] = [set() for _ in self.ranges]
        self.segments: List[List[int]] = [[] for _ in self.ranges]
        for param in buffer.params:
            c = buffer.columns[param.ds_id]
            if c.atom == 0:
                continue
            first = bisect.bisect_right(self.starts, c.offset) - 1
            last = bisect.bisect_right(self.starts, c.offset + c.atom - 1) - 1
            self.of_param[param.ds_id] = list(range(first, last + 1))
            for index in range(first, last + 1):
                self.members[index].add(param.ds_id)
                start, end = self.ranges[index]
                self.segments[index].append(min(end, c.offset + c.atom) - max(start, c.offset))


class StepBoundary:
    def __init__(self, groups: ProcessGroups, configured_bucket: Optional[int], reduce_bucket_size: int, runner,
                 quantization: QuantizationPlan = NO_QUANTIZATION, error_feedback: Optional[ErrorFeedback] = None,
                 tag_prefix: str = "asynchzp", after_sum: Optional[Callable] = None):
        self.groups = groups
        self.tag_prefix = tag_prefix
        self.configured_bucket = configured_bucket
        self.reduce_bucket_size = reduce_bucket_size
        self.pairwise = not backend_reduce_scatter_is_optimal(groups.grad_boundary)
        self.runner = runner
        self.quantization = quantization
        # With error feedback: what the quantization dropped from each gradient row sent (saved in checkpoints).
        self.error_feedback = error_feedback
        # With optimizer offload: `after_sum(index, start, end, members)`, asked on the training thread when a chunk
        # is submitted, gives what the chunk job runs once its sum is done (the copy to the host), or None.
        self.after_sum = after_sum
        self.scratch = Scratch()          # used only inside boundary jobs
        self._grad_chunks: Optional[_Chunks] = None
        self._grad_jobs: Dict[int, object] = {}       # chunk index -> job, this window
        self._waiting: List[set] = []                 # per chunk: parameters whose bucket is not submitted yet
        self._bucket_jobs: List[set] = []             # per chunk: reduce jobs it must wait for
        self._completed: set = set()
        self._refresh: Dict[str, tuple] = {}          # buffer name -> (chunks, jobs) of its latest refresh
        self._refreshing: Dict[str, list] = {}        # buffer name -> jobs of a refresh not yet wholly submitted
        self._chunk_cache: Dict[int, tuple] = {}      # id(buffer) -> (buffer, its chunks): a buffer's are fixed

    def _chunks(self, buffer: ShardedBuffer) -> _Chunks:
        """The buffer's chunks, computed once: the refresh walks the same buffers after every step."""
        cached = self._chunk_cache.get(id(buffer))
        if cached is None or cached[0] is not buffer:
            elements = bucket_elements(self.configured_bucket, self.reduce_bucket_size, buffer.rows * buffer.width)
            cached = self._chunk_cache[id(buffer)] = (buffer, _Chunks(buffer, elements))
        return cached[1]

    def widest_chunk(self, buffer: ShardedBuffer) -> int:
        """Columns of the buffer's widest chunk: what one chunk job of it holds at once, per row."""
        return max((end - start for start, end in self._chunks(buffer).ranges), default=0)

    # ------------------------------------------------------------------------------- gradients
    def _start_window(self, grads: GradShards) -> None:
        self._grad_chunks = self._chunks(grads.buffer)
        if not self._waiting:
            self._waiting = [set(m) for m in self._grad_chunks.members]
            self._bucket_jobs = [[] for _ in self._grad_chunks.ranges]

    def grads_complete(self, grads: GradShards, params, reduce_job, comm_dtype: torch.dtype) -> None:
        """The last backward of the window submitted these parameters' bucket (`reduce_job`): submit every chunk
        whose parameters are now all submitted."""
        self._start_window(grads)
        chunks = self._grad_chunks
        for param in params:
            if param.ds_id in self._completed:
                raise RuntimeError(
                    f"parameter {param.ds_id} was reduced twice in the last backward of an accumulation window, "
                    "after its gradients had started crossing nodes; a parameter must produce its gradient once "
                    "per backward")
            self._completed.add(param.ds_id)
            for index in chunks.of_param.get(param.ds_id, ()):
                self._waiting[index].discard(param.ds_id)
                self._bucket_jobs[index].append(reduce_job)
        for param in params:
            for index in chunks.of_param.get(param.ds_id, ()):
                if not self._waiting[index] and index not in self._grad_jobs:
                    self._submit_grad_chunk(grads, index, comm_dtype)

    def submit_remaining(self, grads: GradShards, comm_dtype: torch.dtype, reduce_jobs: Iterable) -> None:
        """The window's last backward is over: submit every chunk not yet submitted (after all reductions)."""
        if grads.window is not Window.ACCUMULATING:
            return
        self._start_window(grads)
        reduce_jobs = list(reduce_jobs)
        for index in range(len(self._grad_chunks.ranges)):
            if index not in self._grad_jobs:
                self._bucket_jobs[index] = reduce_jobs
                self._submit_grad_chunk(grads, index, comm_dtype)
        grads.window = Window.REDUCED

    def wait_grads(self) -> None:
        for index in sorted(self._grad_jobs):
            self._grad_jobs[index].wait()

    def end_window(self) -> None:
        """After the step (or a discarded window): forget this window's chunks. Their jobs must be done."""
        self.wait_grads()
        self._grad_jobs.clear()
        self._waiting, self._bucket_jobs = [], []
        self._completed.clear()

    def grad_chunks_of(self, ds_id: int) -> List[int]:
        """The indices of the gradient chunks that hold a parameter's columns (this window's chunking)."""
        return self._grad_chunks.of_param.get(ds_id, []) if self._grad_chunks is not None else []

    def grad_chunks_in(self, start: int, end: int) -> List[int]:
        """The indices of this window's gradient chunks that hold any of the columns [start, end)."""
        if self._grad_chunks is None or end <= start:
            return []
        starts = self._grad_chunks.starts
        return list(range(bisect.bisect_right(starts, start) - 1, bisect.bisect_left(starts, end)))

    def chunk_ends(self, buffer: ShardedBuffer) -> List[int]:
        """The end column of each chunk of `buffer` (its refresh's units), in column order."""
        return [end for _, end in self._chunks(buffer).ranges]

    def _submit_grad_chunk(self, grads: GradShards, index: int, comm_dtype: torch.dtype) -> None:
        start, end = self._grad_chunks.ranges[index]
        segments = self._grad_chunks.segments[index]
        dependencies = list(self._bucket_jobs[index])
        earlier = grads.reduced_earlier
        after_sum = (self.after_sum(index, start, end, self._grad_chunks.members[index])
                     if self.after_sum is not None else None)

        def job() -> None:
            for reduction in dependencies:
                reduction.wait()
            with ledger.boundary_phase("sum"):
                self._reduce_chunk(grads.buffer, start, end, comm_dtype, segments)
                if earlier is not None:
                    # A reopened window: its gradient before the reopening, added as Stage 3 adds into its
                    # partition. The copy is dropped after the step, from another stream: its memory waits for this.
                    grads.buffer.data[grads.buffer.own_row, start:end].add_(earlier[start:end])
                    streams.keep_alive(earlier)
            if after_sum is not None:
                after_sum()

        self._grad_jobs[index] = self.runner.submit(job, "cross-node gradient reduction",
                                                    self.groups.grad_boundary.name,
                                                    after=grads.buffer.host_events())

    def _reduce_chunk(self, buffer: ShardedBuffer, start: int, end: int, comm_dtype: torch.dtype,
                      segments: List[int]) -> None:
        boundary, outer = self.groups.grad_boundary, self.groups.outer_replica
        rows, device, cols = buffer.rows, buffer.data.device, end - start
        own = buffer.data[buffer.own_row, start:end]
        plan = self.quantization
        if rows > 1:
            send = self.scratch.get("grad_send", rows * cols, comm_dtype, device).view(rows, cols)
            send.copy_(buffer.data[:, start:end])
            with ledger.tagged(f"{self.tag_prefix}.boundary_grad"):
                if plan.boundary_grad is not None:
                    total = self.scratch.get("grad_sum", cols, torch.float32, device)
                    residual = (self.error_feedback.columns(start, end) if self.error_feedback is not None
                                else None)
                    quantized.reduce_scatter(total, send, boundary, plan.boundary_grad, self.scratch, residual,
                                             segments)
                elif self.pairwise:
                    recv = self.scratch.get("grad_recv", rows * cols, comm_dtype, device).view(rows, cols)
                    all_to_all(recv.view(-1), send.view(-1), boundary).wait()
                    total = self.scratch.get("grad_sum", cols, torch.float32, device)
                    total.copy_(recv[0])
                    for row in recv[1:]:
                        total.add_(row)
                else:
                    total = self.scratch.get("grad_sum", cols, comm_dtype, device)
                    reduce_scatter(total, send.view(-1), boundary).wait()
            own.copy_(total)
        if outer.size > 1:
            with ledger.tagged(f"{self.tag_prefix}.boundary_allreduce"):
                if plan.boundary_allreduce is not None:
                    quantized.all_reduce(own, outer, plan.boundary_allreduce, self.scratch)
                elif own.dtype == comm_dtype:
                    all_reduce(own, outer).wait()
                else:
                    staged = self.scratch.get("grad_outer", cols, comm_dtype, device)
                    staged.copy_(own)
                    all_reduce(staged, outer).wait()
                    own.copy_(staged)

    # ------------------------------------------------------------------------------ parameters
    def start_refresh(self, buffers: Iterable[ShardedBuffer], exact: bool = False) -> None:
        """Submit the refresh of every chunk of `buffers`, in column order (`exact`: never quantized): the rest of a
        refresh `refresh_through` began, or a whole new one."""
        for buffer in buffers:
            self.refresh_through(buffer, buffer.width, exact)
            self._refreshing.pop(buffer.name, None)

    def refresh_through(self, buffer: ShardedBuffer, column: int, exact: bool = False) -> None:
        """Submit the refresh of the chunks of `buffer` that end at or before `column` and are not submitted yet in
        the refresh under way (begun by the first call after `start_refresh` ended the last one). With optimizer
        offload the step writes the own row sub-group by sub-group, and each one's refresh starts while the host
        steps the next; `_post_step`'s `start_refresh` then submits what is left."""
        group = self.groups.param_refresh
        if group.size == 1:
            return
        fmt = None if exact else self.quantization.param_refresh
        chunks = self._chunks(buffer)
        jobs = self._refreshing.get(buffer.name)
        if jobs is None:
            jobs = self._refreshing[buffer.name] = []
            self._refresh[buffer.name] = (chunks, jobs)
        after = buffer.host_events()     # the step's (or a load's) write into the own row, among others
        while len(jobs) < len(chunks.ranges) and chunks.ranges[len(jobs)][1] <= column:
            (start, end), segments = chunks.ranges[len(jobs)], chunks.segments[len(jobs)]
            jobs.append(self.runner.submit(self._refresh_job(buffer, start, end, fmt, segments), "parameter refresh",
                                           group.name, after=after))

    def drop_open_refresh(self) -> None:
        """A step failed while its refresh was being submitted: the next refresh starts from the first chunk."""
        self._refreshing.clear()

    def _refresh_job(self, buffer: ShardedBuffer, start: int, end: int, fmt, segments: List[int]):
        group, rows, own_row = self.groups.param_refresh, buffer.rows, buffer.own_row

        def job() -> None:
            with ledger.boundary_phase("refresh"):
                refresh()

        def refresh() -> None:
            cols = end - start
            recv = self.scratch.get("param_recv", rows * cols, buffer.data.dtype, buffer.data.device)
            with ledger.tagged(f"{self.tag_prefix}.param_refresh"):
                if fmt is not None:
                    quantized.all_gather(recv, buffer.data[own_row, start:end], group, fmt, self.scratch, segments)
                else:
                    all_gather(recv, buffer.data[own_row, start:end], group).wait()
            gathered = recv.view(rows, cols)
            # Every row but the own one, which the gather only read: a reader of DeepSpeed's partition
            # (a checkpoint save) may be reading it meanwhile.
            if own_row:
                buffer.data[:own_row, start:end].copy_(gathered[:own_row])
            if own_row + 1 < rows:
                buffer.data[own_row + 1:, start:end].copy_(gathered[own_row + 1:])

        return job

    def refresh_waits(self, params) -> list:
        """The jobs of the latest refresh that hold any of `params`' columns (what a gather of them waits for,
        by their events: done on the host or not)."""
        if not self._refresh:
            return []
        jobs = {}
        for param in params:
            for chunks, submitted in self._refresh.values():
                for index in chunks.of_param.get(param.ds_id, ()):
                    if index < len(submitted):   # a refresh still being submitted (inside the step) holds fewer
                        jobs[id(submitted[index])] = submitted[index]
        return list(jobs.values())

    def refresh_params(self, buffers: Iterable[ShardedBuffer], exact: bool = False) -> None:
        """Refresh now and wait. At construction `exact` (never quantized), so training starts from the weights
        it was given; after a checkpoint load as after a step, so a resumed run holds what the saved run held."""
        self.start_refresh(buffers, exact=exact)
        self.wait_refresh()

    def wait_refresh(self) -> None:
        """The current stream waits for every refresh (before the shards are rewritten). The jobs stay known
        until the next refresh of their buffer, for the gathers that read what they wrote."""
        for _, jobs in self._refresh.values():
            for job in jobs:
                job.wait()
