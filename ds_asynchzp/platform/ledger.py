"""Communication ledger: every collective of the process, ours and stock DeepSpeed's, with its bytes.

DeepSpeed's ZeRO code talks only through `deepspeed.comm`, and every `deepspeed.comm` call ends in a method
of one backend object (`deepspeed.comm.comm.cdb`; its torch backend captured the torch functions at
construction, so wrapping `torch.distributed` would miss them). Wrapping that object's methods therefore
sees all traffic, whichever engine issued it.

Each record holds the op, the buffer bytes and the **wire bytes**: what one rank sends under the ring model
(all-gather and reduce-scatter of a total size S over n ranks: (n-1)/n * S; all-reduce: 2(n-1)/n * S;
point-to-point: S, counted by the sender). A record is **inter-node** when its group spans more than one node
(for point-to-point: when the peer is on another node). The formulas in docs/ARCHITECTURE.md use the same
model, so ledger figures and formulas are comparable to the byte.

Each record also holds **link bytes**: what this rank itself sends over a node-to-node link if the backend
runs the collective as a ring in group rank order (gloo does for all-gather, all-reduce and reduce-scatter;
its reduce-scatter costs a full all-reduce). A rank's ring successor on another node receives (n-1)/n * S
over the link per ring pass; a point-to-point send to another node puts S on the link. Summed over ranks,
this predicts the byte counters of the node links, which an emulated cluster measures.

Each record also counts the **messages** this rank sends to a rank on another node (`crossing_sends`: a ring
pass sends its successor n-1 of them, an all-to-all one to each peer, a send one). The bytes above are
payload; the library adds a few control bytes per message (gloo: a header, and notifications both ways), which
for the many small calls of quantized collectives reach several percent of a link's bytes. Summed over ranks,
these counts are what `bench.plan_check` needs to add them (`summary()["crossing_messages"]`).

Object collectives (`broadcast_object_list`, `all_gather_object`) carry pickled Python objects of unknown
size; they are recorded with zero bytes and their count.

Time. Each record holds the thread that issued it and its interval from issue to completion (`started`,
`ended`, `seconds`): a synchronous call ends when it returns; an asynchronous one (`async_op=True`, as
DeepSpeed's own prefetching gathers) when its work completes, seen by a completion callback or, at the latest,
by its `wait()`. Two step-level figures come from these intervals:

* exposed communication: time the training (main) thread spent blocked on communication, that is inside a
  synchronous collective, in the `wait()` of an asynchronous one, or waiting for a communication thread's job
  (`note_wait`);
* communication busy time: the length of the union of all collective intervals, whichever thread issued them.

Overlap shows as busy time well above exposed time.

Families. With AutoEP's experts, every record also belongs to one of three families (`summary()["by_family"]`):
`expert` (AsyncHZP's expert flows, tagged `asynchzp.expert.*`, and stock ZeRO-3's collectives over an
expert-data-parallel group), `tokens` (the token all-to-all of an expert-parallel group, which DeepSpeed issues)
and `dense` (everything else). `set_expert_groups` tells the ledger which groups those are.

Models. A job may run several engines (a DPO policy and its reference model); on a node link their bytes cannot
be told apart, nor, under stock ZeRO-3, by process group (both gather over the world). A thread may label the
collectives it issues with the model it is running (`model_scope`); `summary()["by_model"]` totals the labelled
records by label. Only the labelling thread's own records carry the label: a communication thread's collective
for another engine, issued meanwhile, does not.

Host-device copies. With optimizer states on the host, the copies between the device and the host memory are
a flow of their own (`note_host_copy`): bytes to the host and to the device, apart from the collectives
(`summary()["host_device"]`). A copy counts in a summary whose record range holds its position (the number of
records when it was noted).

Quantization scales. A quantized collective sends integer payload and the fp32 scales that decode it. Each
record holds the share of its bytes that is scales (`summary()["by_flow"][flow]["inter_node_scales"]`):
AsyncHZP packs both into one byte buffer and says how much is scales (`carrying_scales`); stock ZeRO++ sends
its scales as separate fp32 collectives (`count_floating_as_scales`, for a run of it).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional

import torch

from ..formulas import flows
from .deepspeed_internals import comm_backend, ds_comm

# method -> (op kind, positional parameter names as torch.distributed spells them, the argument whose size
# is the collective's total size S). The backend's methods are wrapped by decorators that hide their
# signatures, so the parameter order is written out here.
_COLLECTIVES = {
    "all_gather_into_tensor": ("all_gather", "output_tensor input_tensor group async_op", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list tensor group async_op", "tensor_list"),
    "all_gather_coalesced": ("all_gather", "output_tensors input_tensors group async_op", "output_tensors"),
    "reduce_scatter_tensor": ("reduce_scatter", "output_tensor input_tensor op group async_op", "input_tensor"),
    "reduce_scatter": ("reduce_scatter", "output input_list op group async_op", "input_list"),
    "all_reduce": ("all_reduce", "tensor op group async_op", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors op group async_op", "tensors"),
    "broadcast": ("broadcast", "tensor src group async_op", "tensor"),
    "reduce": ("reduce", "tensor dst op group async_op", "tensor"),
    "all_to_all_single": ("all_to_all", "output input output_split_sizes input_split_sizes group async_op", "input"),
    "all_to_all": ("all_to_all", "output_tensor_list input_tensor_list group async_op", "input_tensor_list"),
    "send": ("send", "tensor dst group tag", "tensor"),
    "isend": ("send", "tensor dst group tag", "tensor"),
    "recv": ("recv", "tensor src group tag", "tensor"),
    "irecv": ("recv", "tensor src group tag", "tensor"),
    "broadcast_object_list": ("broadcast_object", "object_list src group device", None),
    "all_gather_object": ("all_gather_object", "object_list obj group", None),
    "barrier": ("barrier", "group async_op device_ids", None),
}


@dataclass
class CommRecord:
    op: str
    method: str
    buffer_bytes: int
    wire_bytes: float
    group_size: int
    group_ranks: tuple
    inter_node: bool
    tag: str
    link_bytes: float = 0.0
    seconds: float = 0.0
    thread: str = ""
    started: float = 0.0           # time.perf_counter() at issue
    phase: str = ""                # training phase at issue (`set_phase`), for the flow (`flows.flow_of`)
    ended: float = 0.0             # ... at completion (0 while in flight)
    scale_share: float = 0.0       # the part of its bytes that is quantization scales (`carrying_scales`)
    # Messages this rank sends to ranks on other nodes: ((peer, count, "ring" | "pairwise"), ...).
    crossing_sends: tuple = ()
    model: str = ""                # the issuing thread's model label (`model_scope`), "" without one


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


# Ring passes a collective makes over every ring edge (gloo's reduce-scatter is an all-reduce underneath).
_RING_PASSES = {"all_gather": 1, "broadcast": 1, "reduce": 1, "reduce_scatter": 2, "all_reduce": 2}


def _ring_wire_bytes(kind: str, total: int, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * total
    if kind in ("all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"):
        return (n - 1) / n * total
    if kind == "send":
        return float(total)
    return 0.0


class CommLedger:
    """Process-wide record of collectives; installed once, read through `mark()` / `summary()`."""

    def __init__(self, node_size: int):
        self.node_size = node_size
        self.records: List[CommRecord] = []
        self._lock = threading.Lock()
        self._tags = threading.local()
        self._scales = threading.local()
        self._models = threading.local()
        # Stock ZeRO++ sends its quantization scales as collectives of their own, in fp32 beside the integer
        # payload (`count_floating_as_scales`); AsyncHZP packs them into the payload (`carrying_scales`).
        self.floating_scale_ops: frozenset = frozenset()
        self._ranks_cache: Dict[int, tuple] = {}
        self._originals: Dict[str, object] = {}
        self._backend = None
        self.token_groups: set = set()    # ranks of expert-parallel groups (the token all-to-all)
        self.expert_groups: set = set()   # ranks of expert-data-parallel groups (stock expert partitions)
        self.waits: List[tuple] = []   # (start, end, what): the training thread blocked on communication
        self.delays: List[tuple] = []  # (start, end): test-only latency injected around collectives (any thread)
        self.host_copies: List[tuple] = []  # (position among the records, "to_host" or "to_device", bytes)
        # (start, end, kind, thread): the optimizer step boundary's phases under offload (`boundary_phase`)
        self.boundary_phases: List[tuple] = []
        # Process-wide, not per thread: a communication thread's collective counts in the phase the training
        # thread is in when it is issued.
        self.phase = ""

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        backend = comm_backend()
        if backend is None:
            raise RuntimeError("the communication ledger needs deepspeed.comm initialised "
                               "(call deepspeed.init_distributed() first)")
        self._backend = backend
        for method in _COLLECTIVES:
            original = getattr(backend, method, None)
            if original is None or method in self._originals:
                continue
            self._originals[method] = original
            setattr(backend, method, self._wrap(method, original))

    def uninstall(self) -> None:
        for method, original in self._originals.items():
            setattr(self._backend, method, original)
        self._originals.clear()

    def _wrap(self, method: str, original):
        kind, names, size_arg = _COLLECTIVES[method]
        names = names.split()

        def recorded(*args, **kwargs):
            arguments = dict(zip(names, args))
            arguments.update(kwargs)
            record = self._record(method, kind, size_arg, arguments)
            record.thread = threading.current_thread().name
            record.started = time.perf_counter()
            result = original(*args, **kwargs)
            returned = time.perf_counter()
            self.note_wait(record.started, returned, method)
            if arguments.get("async_op") and result is not None and hasattr(result, "wait"):
                return _TimedWork(result, record, self)
            self._complete(record, returned)
            return result

        recorded.__wrapped__ = original
        return recorded

    # ------------------------------------------------------------------ time
    def _complete(self, record: CommRecord, when: float) -> None:
        with self._lock:
            if not record.ended or when < record.ended:
                record.ended = when
                record.seconds = when - record.started

    def note_wait(self, start: float, end: float, what: str) -> None:
        """The calling thread was blocked on communication in [start, end); counted only for the training
        (main) thread, whose waits are what a step loses to communication."""
        if threading.current_thread() is threading.main_thread() and end > start:
            with self._lock:
                self.waits.append((start, end, what))

    def note_host_copy(self, direction: str, nbytes: int) -> None:
        if direction not in ("to_host", "to_device"):
            raise ValueError(f"a host copy goes to_host or to_device, not {direction!r}")
        with self._lock:
            self.host_copies.append((len(self.records), direction, int(nbytes)))

    def note_boundary_phase(self, start: float, end: float, kind: str) -> None:
        with self._lock:
            self.boundary_phases.append((start, end, kind, threading.current_thread().name))

    def boundary_phases_between(self, start: float, end: float) -> List[tuple]:
        """The boundary phases that overlap [start, end), clipped to it."""
        with self._lock:
            return [(max(s, start), min(e, end), kind, thread) for s, e, kind, thread in self.boundary_phases
                    if e > start and s < end]

    def note_delay(self, start: float, end: float) -> None:
        """An injected latency: part of communication, so it counts as busy time (and, on the training thread,
        as a wait through `note_wait`)."""
        with self._lock:
            self.delays.append((start, end))

    def exposed_seconds(self, start: float, end: float) -> float:
        """Time in [start, end) the training thread was blocked on communication."""
        with self._lock:
            return sum(max(0.0, min(e, end) - max(s, start)) for s, e, _ in self.waits)

    def busy_seconds(self, start: float, end: float, mark: int = 0) -> float:
        """Length of the union of collective intervals (records from `mark` on), clipped to [start, end)."""
        intervals = [(max(r.started, start), min(r.ended or end, end)) for r in self.since(mark)
                     if r.started < end and (r.ended or end) > start]
        with self._lock:
            intervals += [(max(s, start), min(e, end)) for s, e in self.delays if s < end and e > start]
        intervals.sort()
        total, cursor = 0.0, start
        for s, e in intervals:
            s = max(s, cursor)
            if e > s:
                total += e - s
                cursor = e
        return total

    def waits_between(self, start: float, end: float) -> List[tuple]:
        with self._lock:
            return [w for w in self.waits if w[1] > start and w[0] < end]

    # ------------------------------------------------------------------ recording
    def _group_ranks(self, group) -> tuple:
        key = id(group) if group is not None else 0
        ranks = self._ranks_cache.get(key)
        if ranks is None:
            if group is None:
                world = self._backend.get_world_size()
                ranks = tuple(range(world))
            else:
                ranks = tuple(self._backend.get_global_rank(group, i)
                              for i in range(self._backend.get_world_size(group)))
            self._ranks_cache[key] = ranks
        return ranks

    def _crossing(self, kind: str, total: int, ranks: tuple) -> tuple:
        """(link bytes, crossing sends) of this rank in one collective over `ranks`: what it puts on node links
        under gloo's rings in group order, and its messages to ranks on other nodes (peer, count, kind)."""
        n = len(ranks)
        me = self._backend.get_rank()
        if n <= 1 or me not in ranks:
            return 0.0, ()
        node = me // self.node_size
        if kind == "all_to_all":
            remote = [r for r in ranks if r // self.node_size != node]
            return total / n * len(remote), tuple((r, 1, "pairwise") for r in remote)
        successor = ranks[(ranks.index(me) + 1) % n]
        passes = _RING_PASSES.get(kind, 0)
        if not passes or successor // self.node_size == node:
            return 0.0, ()
        return passes * (n - 1) / n * total, ((successor, passes * (n - 1), "ring"),)

    def _record(self, method: str, kind: str, size_arg: Optional[str], arguments: dict) -> CommRecord:
        group = arguments.get("group")
        ranks = self._group_ranks(group)
        n = len(ranks)
        total = _nbytes(arguments.get(size_arg)) if size_arg else 0
        if kind in ("send", "recv"):
            peer = arguments.get("dst") if kind == "send" else arguments.get("src")
            me = self._backend.get_rank()
            inter = peer is not None and peer // self.node_size != me // self.node_size
            wire = float(total) if kind == "send" else 0.0
            link = wire if inter else 0.0
            sends = ((peer, 1, "pairwise"),) if inter and kind == "send" else ()
            ranks, n = (me, peer), 2
        else:
            inter = len({r // self.node_size for r in ranks}) > 1
            wire = _ring_wire_bytes(kind, total, n)
            link, sends = self._crossing(kind, total, ranks)
        record = CommRecord(op=kind, method=method, buffer_bytes=total, wire_bytes=wire, group_size=n,
                            group_ranks=tuple(ranks), inter_node=inter, tag=self.current_tag(), link_bytes=link,
                            phase=self.phase, scale_share=self._scale_share(kind, arguments.get(size_arg)),
                            crossing_sends=sends, model=getattr(self._models, "label", ""))
        with self._lock:
            self.records.append(record)
        return record

    # ------------------------------------------------------------------ tags and phases
    def set_phase(self, phase: str) -> None:
        """The training thread enters forward, backward or step ("" outside them)."""
        if phase and phase not in flows.PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {flows.PHASES}")
        self.phase = phase

    def current_tag(self) -> str:
        stack = getattr(self._tags, "stack", None)
        return stack[-1] if stack else ""

    @contextlib.contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        """Label the collectives issued inside the block (per thread)."""
        stack = getattr(self._tags, "stack", None)
        if stack is None:
            stack = self._tags.stack = []
        stack.append(tag)
        try:
            yield
        finally:
            stack.pop()

    @contextlib.contextmanager
    def model_scope(self, label: str) -> Iterator[None]:
        """Label the collectives this thread issues inside the block with the model it runs (`by_model`)."""
        previous = getattr(self._models, "label", "")
        self._models.label = label
        try:
            yield
        finally:
            self._models.label = previous

    # ------------------------------------------------------------------ quantization scales
    @contextlib.contextmanager
    def carrying_scales(self, share: float) -> Iterator[None]:
        """The collectives issued inside the block (per thread) send quantized rows whose bytes are `share`
        quantization scales and the rest payload."""
        previous = getattr(self._scales, "share", 0.0)
        self._scales.share = share
        try:
            yield
        finally:
            self._scales.share = previous

    def count_floating_as_scales(self, ops=("all_gather", "all_to_all")) -> None:
        """From now on an fp32 collective of one of `ops` carries quantization scales: true of a run of stock
        ZeRO++ with qwZ and qgZ, whose weights and gradients travel as integers and their scales apart, in fp32
        (DeepSpeed's unsplittable-gradient fallback is a reduce-scatter, so not counted; the unquantized gather of
        a frozen parameter is in the training dtype, so not counted either, except in an fp32 run)."""
        self.floating_scale_ops = frozenset(ops)

    def _scale_share(self, kind: str, tensor) -> float:
        share = getattr(self._scales, "share", 0.0)
        if share or kind not in self.floating_scale_ops:
            return share
        while isinstance(tensor, (list, tuple)) and tensor:
            tensor = tensor[0]
        return 1.0 if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 else 0.0

    # ------------------------------------------------------------------ families
    def set_expert_groups(self, token_groups, expert_groups) -> None:
        """AutoEP's groups of this rank: expert-parallel (tokens) and expert-data-parallel (expert weights)."""
        self.token_groups = {tuple(g) for g in token_groups}
        # With autoep_size 1 the expert-data-parallel group is the whole world, like the dense parameters': stock
        # traffic over it cannot be told apart, and counts as dense (AsyncHZP's own flows are tagged).
        world = tuple(range(self._backend.get_world_size()))
        self.expert_groups = {tuple(g) for g in expert_groups if tuple(g) != world}

    def family_of(self, record: CommRecord) -> str:
        if record.tag.startswith("asynchzp.expert."):
            return "expert"
        if record.tag.startswith("asynchzp."):
            return "dense"
        if record.op == "all_to_all" and record.group_ranks in self.token_groups:
            return "tokens"
        if record.group_ranks in self.expert_groups:
            return "expert"
        return "dense"

    # ------------------------------------------------------------------ reading
    def mark(self) -> int:
        with self._lock:
            return len(self.records)

    def since(self, mark: int = 0, until: Optional[int] = None) -> List[CommRecord]:
        with self._lock:
            return list(self.records[mark:until])

    def summary(self, mark: int = 0, until: Optional[int] = None, skip_tags: tuple = (),
                training_thread_only: bool = False) -> dict:
        """Ring-model wire bytes intra/inter node and per op kind, predicted node-link bytes (`link_bytes`) and
        time in collectives (`seconds`) of the records in [mark, until), leaving out those tagged with one of
        `skip_tags` (inspections a caller made in the middle of a measurement); with `training_thread_only`, only
        the training (main) thread's collectives, barriers left out (what a script itself issues between two
        steps, without a communication thread's late work of the step before)."""
        out = {"intra_node": 0.0, "inter_node": 0.0, "calls": 0, "link_bytes": 0.0, "seconds": 0.0, "by_op": {},
               "by_family": {}, "by_flow": {}, "host_device": {"to_host": 0, "to_device": 0},
               "crossing_messages": {"ring": {}, "pairwise": {}}, "by_model": {}}
        with self._lock:
            copies = list(self.host_copies)
        for position, direction, nbytes in copies if not training_thread_only else ():
            if position >= mark and (until is None or position < until):
                out["host_device"][direction] += nbytes
        main = threading.main_thread().name
        for record in self.since(mark, until):
            if record.tag in skip_tags:
                continue
            if training_thread_only and (record.thread != main or record.op == "barrier"):
                continue
            where = "inter_node" if record.inter_node else "intra_node"
            out[where] += record.wire_bytes
            out["calls"] += 1
            out["link_bytes"] += record.link_bytes
            out["seconds"] += record.seconds
            for peer, count, style in record.crossing_sends:
                by_peer = out["crossing_messages"][style]
                by_peer[peer] = by_peer.get(peer, 0) + count
            if record.model:
                part = out["by_model"].setdefault(record.model, {"intra_node": 0.0, "inter_node": 0.0, "calls": 0,
                                                                 "link_bytes": 0.0})
                part[where] += record.wire_bytes
                part["calls"] += 1
                part["link_bytes"] += record.link_bytes
            for key, name in (("by_op", record.op), ("by_family", self.family_of(record)),
                              ("by_flow", flows.flow_of(record.op, record.tag, record.phase))):
                part = out[key].setdefault(name, {"intra_node": 0.0, "inter_node": 0.0, "calls": 0,
                                                  "intra_node_scales": 0.0, "inter_node_scales": 0.0})
                part[where] += record.wire_bytes
                part[where + "_scales"] += record.wire_bytes * record.scale_share
                part["calls"] += 1
        return out

    def records_as_dicts(self, mark: int = 0, until: Optional[int] = None) -> List[dict]:
        return [asdict(r) for r in self.since(mark, until)]


class _TimedWork:
    """An asynchronous collective's work: completion ends the record's interval; a training-thread `wait()`
    counts as exposed communication."""

    def __init__(self, work, record: CommRecord, ledger_: CommLedger):
        self._work, self._record, self._ledger = work, record, ledger_
        try:
            work.get_future().add_done_callback(lambda _: ledger_._complete(record, time.perf_counter()))
        except Exception:  # noqa: BLE001 - backends without futures: completion is seen at wait()
            pass

    def wait(self, *args, **kwargs):
        started = time.perf_counter()
        result = self._work.wait(*args, **kwargs)
        done = time.perf_counter()
        self._ledger._complete(self._record, done)
        self._ledger.note_wait(started, done, self._record.method)
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


_LEDGER: Optional[CommLedger] = None


def default_node_size() -> int:
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return ds_comm.get_world_size() if ds_comm.is_initialized() else 1


def install(node_size: Optional[int] = None) -> CommLedger:
    """Start counting (idempotent). Needs `deepspeed.comm` initialised."""
    global _LEDGER
    if _LEDGER is None:
        _LEDGER = CommLedger(node_size or default_node_size())
        _LEDGER.install()
    return _LEDGER


def get() -> Optional[CommLedger]:
    return _LEDGER


def mark() -> int:
    return _LEDGER.mark() if _LEDGER else 0


def summary(mark: int = 0, until: Optional[int] = None, skip_tags: tuple = (),
            training_thread_only: bool = False) -> dict:
    if _LEDGER is None:
        raise RuntimeError("the communication ledger is not installed: call ds_asynchzp.ledger.install() "
                           "after deepspeed.init_distributed()")
    return _LEDGER.summary(mark, until, skip_tags, training_thread_only)


def note_wait(start: float, end: float, what: str) -> None:
    if _LEDGER is not None:
        _LEDGER.note_wait(start, end, what)


def note_host_copy(direction: str, nbytes: int) -> None:
    """Bytes copied between the device and host memory (optimizer offload), counted apart from collectives."""
    if _LEDGER is not None:
        _LEDGER.note_host_copy(direction, nbytes)


# The phases of the optimizer step boundary under offload, timed on the host (on a device with streams a copy's
# interval is its enqueue): the cross-node sum of a chunk, its copy to the host, the host step, the copy back to
# the device, the parameter refresh of a chunk.
BOUNDARY_PHASES = ("sum", "copy_out", "host_step", "copy_back", "refresh")


@contextlib.contextmanager
def boundary_phase(kind: str) -> Iterator[None]:
    """Time the block as one busy interval of a boundary phase (`BOUNDARY_PHASES`), when a ledger is installed."""
    if _LEDGER is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        _LEDGER.note_boundary_phase(start, time.perf_counter(), kind)


def note_delay(start: float, end: float) -> None:
    if _LEDGER is not None:
        _LEDGER.note_delay(start, end)


def tagged(tag: str):
    return _LEDGER.tagged(tag) if _LEDGER else contextlib.nullcontext()


def model_scope(label: str):
    return _LEDGER.model_scope(label) if _LEDGER else contextlib.nullcontext()


def carrying_scales(share: float):
    return _LEDGER.carrying_scales(share) if _LEDGER else contextlib.nullcontext()


def set_phase(name: str) -> None:
    """The training phase (forward, backward, step; "" between them) of the training thread's next records."""
    if _LEDGER is not None:
        _LEDGER.set_phase(name)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a training phase (forward, backward, step) of the training thread for the records issued in it."""
    if _LEDGER is None:
        yield
        return
    _LEDGER.set_phase(name)
    try:
        yield
    finally:
        _LEDGER.set_phase("")
