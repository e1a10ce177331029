"""Per micro-step: gather full parameters from the parameter shards, inside the d_p shard group.

Replaces DeepSpeed's per-parameter `all_gather_coalesced`, which the parameter coordinator calls for every
module in forward and backward. One all-gather per dtype (a concatenation would silently promote a bf16
parameter gathered with an fp32 one); each member contributes its T_p atoms of every requested parameter, and
the gathered [d_p, T_p, atom] block is transposed into a pool buffer per parameter, in atom order.

The gathers run as jobs of the `gather` flow: its thread, or inline on the training thread when nothing is
gathered ahead. Each job first waits for the parameter refresh of the columns it reads (the once-per-step
refresh runs on the boundary thread, overlapped with the forward). The handle the
coordinator waits on publishes the parameters; their buffers go back to the pool when the coordinator releases
them (`released`).

Prefetch: the sequence of requests of one micro-step (forward then backward, from `new_sequence` to the next)
is recorded; while the next micro-step repeats it, each request keeps `prefetch_depth` gathers of the requests
that follow in flight, so they run while the current module computes. Consecutive small requests (together at
most `COALESCE_NUMEL` elements, no parameter twice) share one gather: one job and one collective for many tiny
modules, where each collective would cost far more in latency and host time than in bytes (the bytes are the
same). A request that departs from the recording stops the prefetch for the rest of the sequence and becomes
the new recording; a prefetched gather nobody asked for is given back at the next sequence. Every rank records
the same requests and cuts them into the same gathers, so every rank issues the same collectives.

Ordering on the device (`platform.streams`). The coordinator asks for gathers, and waits for them, inside
DeepSpeed's allgather stream, which never waits on compute; so nothing here rests on the current stream. A
gather job's stream waits on: the events its pool buffers were released with (recorded on the compute stream,
where the module that read the parameter ran, when the coordinator released it), the shard buffers' host
events (the optimizer's step, a load, an edit) and the refresh jobs of the columns it reads. The compute stream
is the one current when the engine's forward starts a micro-step; a published parameter is waited for on both
the current stream and compute.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import ops
from ..platform import ledger
from ..errors import PartitionWriteError
from ..platform import streams
from ..platform.deepspeed_internals import mark_available, mark_inflight
from ..platform.process_groups import Group
from ..quantization import QuantFormat
from ..state.buffer_pool import BufferPool
from ..state.scratch import Scratch
from ..state.param_shards import ParamShards
from . import quantized
from .collectives import all_gather

Key = Tuple[int, ...]

# Elements up to which consecutive prefetched requests share one gather. Below it a gather is latency-bound (NCCL's
# small all-gathers, gloo's round trips, and the host work of a job); the in-flight memory it adds is at most
# prefetch_depth times this.
COALESCE_NUMEL = 1 << 16


class GatherHandle:
    """What the parameter coordinator waits on; `wait` publishes the full parameters (idempotent: the
    coordinator calls it once per parameter of a coalesced fetch)."""

    def __init__(self, owner: "ParamGather", params: List[torch.nn.Parameter], job):
        self.owner, self.params, self.job = owner, params, job
        self.complete = False

    def wait(self, handle_dependency: bool = True) -> None:
        if self.complete:
            return
        slots: Dict[int, torch.Tensor] = self.job.wait(also=[self.owner.compute])
        for param in self.params:
            slot = slots[param.ds_id]
            self.owner.leases[param.ds_id] = slot
            mark_available(param, slot.narrow(0, 0, param.ds_numel).view(param.ds_shape))
        self.complete = True

    def discard(self) -> None:
        """A prefetched gather nobody asked for: its buffers go back to the pool unpublished (the next writer
        waits for this one's write). The current stream waits for it too: whoever rewrites the shards next (the
        step, a load) must come after its reads. Only this request's buffers: a coalesced job also holds those of
        other requests, which their own handles publish or give back."""
        slots = self.job.wait(also=[self.owner.compute])
        for param in self.params:
            self.owner.pool.release(slots[param.ds_id], [self.job.done_event])


@dataclass
class GatherSource:
    """One family of parameters (`runtime.placement`): its shards, its d_p group, the wire format of its
    coordinator gathers (quantized_weights) and the refresh jobs a read must wait for."""

    shards: ParamShards
    group: Group
    quantize: Optional[QuantFormat]
    refresh_waits: Callable
    tag_prefix: str = "asynchzp"

    def tag(self, flow: str) -> str:
        """The ledger tag of one of this family's flows (`asynchzp.param_gather`, `asynchzp.expert.inspect`)."""
        return f"{self.tag_prefix}.{flow}"


class ParamGather:
    def __init__(self, sources: Sequence[GatherSource], runner, pool: BufferPool, prefetch_depth: int):
        self.sources, self.runner, self.pool = list(sources), runner, pool
        self.prefetch_depth = prefetch_depth if runner.is_async else 0
        self.compute = streams.current()           # where published parameters are read; see new_sequence
        self.leases: Dict[int, torch.Tensor] = {}  # ds_id -> pool buffer its published full value lives in
        self.scratch = Scratch()                   # send/receive buffers, used only inside gather jobs
        self._source_of: Dict[int, GatherSource] = {}
        self._recording: List[Tuple[Key, List[torch.nn.Parameter]]] = []
        self._replay: List[Tuple[Key, List[torch.nn.Parameter]]] = []
        self._position: Optional[int] = 0
        self._prefetched: "OrderedDict[Key, GatherHandle]" = OrderedDict()
        self._ahead: deque = deque()     # end (replay index) of each prefetched gather not yet wholly requested
        self._planned = 0                # replay index up to which requests were prefetched
        # ds_id -> (family index, dtype name, shard buffer, pool buffer size, atom, [rows, atom] view of its shard):
        # fixed once the shards exist, until `close`.
        self._plans: Dict[int, tuple] = {}
        # Requests served, of them already prefetched, and sequences that departed from the recording.
        self.stats = {"requests": 0, "prefetched": 0, "departures": 0}

    def source_of(self, param) -> GatherSource:
        source = self._source_of.get(param.ds_id)
        if source is None:
            holders = [s for s in self.sources if s.shards.holds(param)]
            if not holders:  # every trainable or frozen parameter was given a family at initialization
                raise RuntimeError(f"parameter ds_id={param.ds_id} (shape {tuple(param.ds_shape)}) belongs to no "
                                   "family's parameter shards; was it added to the model after initialize()?")
            source = self._source_of[param.ds_id] = holders[0]
        return source

    def _plan(self, param) -> tuple:
        """What every gather of `param` needs, looked up once (this runs for every parameter of every request)."""
        plan = self._plans.get(param.ds_id)
        if plan is None:
            source = self.source_of(param)
            buffer = source.shards.buffer_of(param)
            atom = buffer.columns[param.ds_id].atom
            plan = self._plans[param.ds_id] = (self.sources.index(source), str(buffer.data.dtype), buffer,
                                               source.group.size * source.shards.rows * atom, atom, buffer.atoms(param),
                                               buffer.own_atom(param).data_ptr() if atom else None)
        return plan

    def _check_partition(self, param, plan: tuple) -> None:
        """DeepSpeed's partition of `param` is a view of its own atom. Code that rebinds it (`param.ds_tensor.data =
        t`, as some of DeepSpeed's tests do) makes stock ZeRO-3 gather `t` from that rank: where every gather reads
        the own atom (d_p = d_o = N) the same holds here once `t` is copied into it; elsewhere other ranks' gathers
        read copies of the atom that only a collective could update, so the write is refused by name (on the ranks
        that rebound; the others then wait in the gather until the group's timeout names it)."""
        if plan[6] is None or param.ds_tensor.data_ptr() == plan[6]:
            return
        source, buffer = self.sources[plan[0]], plan[2]
        name = getattr(param, "ds_param_name", None) or f"ds_id {param.ds_id}"
        own = buffer.own_atom(param)
        value = param.ds_tensor.data
        if not source.shards.own_writes_reach_every_gather or value.numel() != own.numel():
            raise PartitionWriteError(
                f"the partition of parameter {name} (param.ds_tensor) was rebound outside DeepSpeed. Under async_hzp "
                "with param_shard_size < optimizer_shard_size, or optimizer_shard_size < the world, other ranks "
                "gather copies of it that would keep the old value. Write parameters with "
                "deepspeed.zero.GatheredParameters(params, modifier_rank=r) on every rank, or set "
                "async_hzp.param_shard_size and optimizer_shard_size to the world size.")
        # The value was written on the compute stream; this copy may run on DeepSpeed's gather stream, and the
        # value's memory goes back to the allocator once the partition no longer points at it.
        streams.wait([streams.record(self.compute)])
        own.copy_(value.reshape(-1))
        streams.keep_alive(value)
        param.ds_tensor.data = own
        buffer.note_host_access()

    def close(self) -> None:
        """Forget the shard views looked up for gathers, so that the shard buffers can go (`destroy`)."""
        self._plans.clear()

    # ------------------------------------------------------------------------------ the gather job
    def _submit(self, params: Sequence[torch.nn.Parameter], flow: str, quantize: bool = False,
                checked: bool = False):
        params = sorted(params, key=lambda p: p.ds_id)     # the concatenation order is part of the contract
        # One collective per family (its own group) and dtype (a concatenation would promote silently).
        by_key: Dict[tuple, List[torch.nn.Parameter]] = {}
        for param in params:
            plan = self._plan(param)
            if not checked:     # the coordinator's requests were checked before they were marked in flight
                self._check_partition(param, plan)
            by_key.setdefault(plan[:2], []).append(param)
        groups = [(self.sources[key[0]], members) for key, members in sorted(by_key.items())]
        waits = [job for source, members in groups for job in source.refresh_waits(members)]
        # Output buffers are taken here, on the training thread, in program order: which pooled buffer is free
        # then depends only on what the training thread released before, never on thread timing (so the pool
        # stops growing once warmed up). The job's stream waits on their release events and on the training
        # thread's latest accesses to the shard buffers it reads.
        slots, after, read = {}, [], {}
        for _, members in groups:
            for param in members:
                _, _, buffer, numel, _, _, _ = self._plans[param.ds_id]
                read[id(buffer)] = buffer
                slots[param.ds_id], released = self.pool.acquire(numel, buffer.data.dtype, buffer.data.device,
                                                                 readers_stream=self.compute)
                after.extend(released)
        for buffer in read.values():
            after.extend(buffer.host_events())

        def job() -> Dict[int, torch.Tensor]:
            for refresh in waits:
                refresh.wait()
            for source, members in groups:
                with ledger.tagged(source.tag(flow)):
                    self._gather(members, slots, source, source.quantize if quantize else None)
            return slots

        return self.runner.submit(job, "parameter all-gather", ",".join(s.group.name for s, _ in groups),
                                  after=after)

    def _gather(self, params: List[torch.nn.Parameter], slots: Dict[int, torch.Tensor], source: GatherSource,
                fmt: Optional[QuantFormat]) -> None:
        rows, group = source.shards.rows, source.group
        d_p = group.size
        plans = [self._plans[p.ds_id] for p in params]
        atoms = [plan[4] for plan in plans]
        width = rows * sum(atoms)
        data = plans[0][2].data
        # One pass each way: the shard rows of every parameter into the send buffer, and the gathered
        # [d_p, width] block into each parameter's pool buffer in atom order (the local transpose).
        send = ops.pack([plan[5] for plan in plans], out=self.scratch.get("send", width, data.dtype, data.device))
        recv = self.scratch.get("recv", d_p * width, data.dtype, data.device)
        if fmt is not None:
            quantized.all_gather(recv, send, group, fmt, self.scratch, segments=[rows * a for a in atoms])
        else:
            all_gather(recv, send, group).wait()
        ops.unpack_gathered(recv, [slots[p.ds_id] for p in params], atoms, d_p, rows)

    # --------------------------------------------------------------------- the coordinator's entry points
    FETCH = "param_gather"   # the coordinator's fetches (and their prefetch): the quantized ones

    def all_gather_coalesced(self, params, safe_mode: bool = False, quantize: bool = False,
                             flow: str = FETCH) -> GatherHandle:
        """Drop-in for DeepSpeed's per-parameter `all_gather_coalesced` (same arguments, same handle protocol)."""
        params = list(params)
        for param in params:     # before the parameters count as in flight: a refusal leaves them as they were
            self._check_partition(param, self._plan(param))
        mark_inflight(params)
        key: Key = tuple(sorted(p.ds_id for p in params))
        handle = self._prefetched.pop(key, None)
        self.stats["requests"] += 1
        if handle is not None:
            self.stats["prefetched"] += 1
            handle.params = params
        else:
            handle = GatherHandle(self, params, self._submit(params, flow, quantize=flow == self.FETCH, checked=True))
        self._follow(key, params)
        return handle

    def released(self, param) -> None:
        """The coordinator released `param` (its data no longer points into the pool buffer): reuse the buffer."""
        slot = self.leases.get(param.ds_id)
        if slot is None:
            return
        data = param.data
        if data.numel() and data.data_ptr() == slot.data_ptr():
            return    # still published (persistent, or kept for reuse)
        del self.leases[param.ds_id]
        # The module that read it ran on compute; a reader on the current stream (if another) is covered too.
        self.pool.release(slot, [streams.record(s) for s in streams.distinct([self.compute, streams.current()])])

    def regather_in_place(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Rewrite already-gathered parameters (ZeRO-3 persistent ones) from their refreshed shards, in place."""
        if not params:
            return
        slots = self._submit(params, "persistent_regather").wait()
        for param in params:
            slot = slots[param.ds_id]
            param.data.copy_(slot.narrow(0, 0, param.ds_numel).view(param.ds_shape))
            self.pool.release(slot, [streams.record()])

    def full_value(self, param) -> torch.Tensor:
        """A copy of the full parameter built from its shard (collective; publishes nothing)."""
        slot = self._submit([param], "inspect").wait()[param.ds_id]
        value = slot.narrow(0, 0, param.ds_numel).view(param.ds_shape).clone()
        self.pool.release(slot, [streams.record()])
        return value

    # ------------------------------------------------------------------------------------- prefetch
    def new_sequence(self) -> None:
        """A micro-step starts (the engine's forward): replay the last recording from its start. The stream
        current here, outside DeepSpeed's hooks, is where this micro-step's modules compute."""
        self.compute = streams.current()
        self.drop_prefetched()
        if self._recording:
            self._replay = self._recording
        self._recording = []
        self._position = 0
        self._planned = 0

    def pause(self) -> None:
        """The shards are about to be rewritten (optimizer step, checkpoint load, a modified parameter): give back
        what was prefetched from the old values and prefetch nothing until the next micro-step starts."""
        self.drop_prefetched()
        self._position = None

    def drop_prefetched(self) -> None:
        """Give back every prefetched gather not asked for (also before anything rewrites the shards)."""
        self._ahead.clear()
        while self._prefetched:
            _, handle = self._prefetched.popitem(last=False)
            handle.discard()

    def _follow(self, key: Key, params: List[torch.nn.Parameter]) -> None:
        self._recording.append((key, params))
        if self._position is None:
            return
        if self._position < len(self._replay) and self._replay[self._position][0] == key:
            self._position += 1
        else:
            self._position = None       # the sequence departs from the recording: stop prefetching
            self.stats["departures"] += 1
            self.drop_prefetched()
            return
        while self._ahead and self._ahead[0] <= self._position:
            self._ahead.popleft()       # every request of that gather has been asked for: it is no longer ahead
        while len(self._ahead) < self.prefetch_depth and self._prefetch_next():
            pass

    def _prefetch_next(self) -> bool:
        """Submit the next gather of the replay: the next request, with the small ones after it while they fit in
        `COALESCE_NUMEL` elements and share no parameter (one buffer per parameter per gather). Stops short of a
        request still prefetched from earlier (the same module again): it is submitted once that one is taken.
        False when nothing could be submitted."""
        start = max(self._planned, self._position)
        end, numel, ids = start, 0, set()
        while end < len(self._replay):
            key, params = self._replay[end]
            size = sum(p.ds_numel for p in params)
            if key in self._prefetched or (end > start and (numel + size > COALESCE_NUMEL or not ids.isdisjoint(key))):
                break
            numel += size
            ids.update(key)
            end += 1
        if end == start:
            return False
        requests = self._replay[start:end]
        job = self._submit([p for _, params in requests for p in params], self.FETCH, quantize=True)
        for key, params in requests:
            self._prefetched[key] = GatherHandle(self, params, job)
        self._planned = end
        self._ahead.append(end)
        return True
