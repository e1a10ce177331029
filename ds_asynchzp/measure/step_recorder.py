"""What one rank measures of each optimizer step of an engine: loss, time, bytes by flow, memory, layout.

One implementation for both A/B tools: ``asynchzp-bench``'s rank loop calls it around its own steps, and
``asynchzp-ab`` attaches it to the engine that ``ds_asynchzp.initialize`` builds inside the user's script
(`measure.recording`). Every arm is recorded alike, stock ones too: the figures come from the communication
ledger (every collective, ours and DeepSpeed's) and from the process, never from the optimizer's own counters.

A record (`StepRecorder.finish`) is one rank's: per-step entries, the steady-state byte totals, memory and the
layout; `bench.aggregate` combines the ranks' records into an arm.
"""

from __future__ import annotations

import dataclasses
import resource
import time

from ..platform import ledger
from ..resolved_layout import LayoutSizes
from .boundary import boundary_chunks, boundary_record
from .memory import model_state_bytes

LINK_DEVICE = "eth0"
#: The emulated cluster's topologies (`netem.topology`): one link per node, or one per rank.
SHARED, RAILS = "shared", "rails"


def link_device(rank: int, node_size: int, topology: str) -> str | None:
    """The link whose transmit counter this rank reads: on one link per node, local rank 0 reads it for its node;
    on rails every rank reads its own (``eth<local rank>``). None: this rank reads none."""
    local = rank % node_size
    if topology == RAILS:
        return f"eth{local}"
    return LINK_DEVICE if local == 0 else None


def node_link_counter(device: str = LINK_DEVICE, unit: str = "bytes") -> str:
    """A transmit counter (``bytes`` or ``packets``) of an emulated node's link, inside the node's namespace."""
    return f"/sys/class/net/{device}/statistics/tx_{unit}"


def _read_int(path: str) -> int:
    with open(path, encoding="ascii") as f:
        return int(f.read())


def peak_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def device_memory_peaks(device) -> dict | None:
    """Peak bytes the caching allocator had allocated and reserved on a CUDA device; None elsewhere."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return {"allocated": int(torch.cuda.max_memory_allocated(device)),
            "reserved": int(torch.cuda.max_memory_reserved(device))}


def device_name(device) -> str:
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def families_of(engine) -> dict | None:
    """Per AsyncHZP family (dense, AutoEP experts): the layout it resolved to."""
    layouts = getattr(engine.optimizer, "hzp_family_layouts", None)
    if layouts is None:
        return None
    return {name: dataclasses.asdict(layout) for name, layout in layouts().items()}


def fp32_grad_bytes(engine) -> int:
    """Bytes of the fp32 gradients the optimizer reads, the ``.grad`` of its fp32 master partitions (each storage
    once): under offload, the host buffers the gradients are copied into."""
    from ..platform.deepspeed_internals import stage3_model_state_tensors

    seen, total = set(), 0
    for master in stage3_model_state_tensors(engine.optimizer, engine.module)["master"]:
        grad = master.grad
        if grad is None or grad.untyped_storage().data_ptr() in seen:
            continue
        seen.add(grad.untyped_storage().data_ptr())
        total += grad.untyped_storage().nbytes()
    return total


def stock_layout(ds_config: dict, world: int, node_size: int) -> tuple[dict, str]:
    """The layout dict (keys `RECORD_KEYS` and "auto_reason") and a one-line description of a stock ZeRO-3 arm.

    Stock ZeRO-3 shards parameters, gradients and optimizer states over the whole world; ZeRO++ hpZ adds a
    secondary parameter partition over ``zero_hpz_partition_size`` ranks, from which the micro-steps gather, so
    that is its parameter shard size (the primary partition stays over the world, as do grads and optimizer)."""
    hpz = int((ds_config.get("zero_optimization") or {}).get("zero_hpz_partition_size") or 1)
    param = hpz if hpz > 1 else world
    layout = {**LayoutSizes(world, node_size, param, world, world).as_dict(), "auto_reason": None}
    where = f"world={world} ({world // node_size} node(s) x {node_size} ranks)"
    if hpz > 1:
        text = (f"ZeRO++ hpZ layout: {where}; params: primary partition over {world}, secondary over {hpz} "
                f"({world // hpz} replicas); grads and optimizer states over {world}")
    else:
        text = f"ZeRO-3 layout: {where}; params, grads and optimizer states sharded over {world} (1 replica)"
    return layout, text


def layout_of(engine, ds_config: dict, world: int, node_size: int) -> tuple[dict, str]:
    """The resolved layout this rank trains with: AsyncHZP's own, else the stock arm's."""
    hzp = getattr(engine.optimizer, "hzp_layout", None)
    if hzp is None:
        return stock_layout(ds_config, world, node_size)
    layout = dict(hzp.as_dict())
    layout.setdefault("auto_reason", None)
    return layout, hzp.describe()


def _timeline(comm_ledger, mark: int, start: float, end: float) -> dict:
    """One step's communication as intervals relative to its start: every collective by issuing thread (with
    its tag), and the training thread's waits on communication. Enough to draw compute against each thread."""
    collectives = [{"thread": r.thread, "op": r.op, "tag": r.tag or r.op, "start": r.started - start,
                    "end": (r.ended or end) - start, "inter_node": r.inter_node}
                   for r in comm_ledger.since(mark) if r.started < end]
    waits = [{"start": max(s, start) - start, "end": min(e, end) - start, "what": what}
             for s, e, what in comm_ledger.waits_between(start, end)]
    phases = [{"kind": kind, "thread": thread, "start": s - start, "end": e - start}
              for s, e, kind, thread in comm_ledger.boundary_phases_between(start, end)]
    return {"duration_s": end - start, "collectives": collectives, "waits": waits, "boundary_phases": phases}


def _per_step(totals: dict, steps: int) -> dict:
    """Byte totals over the steady steps as per-step means, in the shape `bench.aggregate` reads."""
    return {"steps": steps,
            "intra_node": totals["intra_node"] / steps, "inter_node": totals["inter_node"] / steps,
            "link_bytes": totals["link_bytes"] / steps,
            "by_op": {op: {"intra_node": v["intra_node"] / steps, "inter_node": v["inter_node"] / steps}
                      for op, v in totals["by_op"].items()},
            "by_family": {name: {"intra_node": v["intra_node"] / steps, "inter_node": v["inter_node"] / steps}
                          for name, v in totals["by_family"].items()},
            # Copies between device and host memory that AsyncHZP's offload notes (stock's are not noted).
            "host_device": {d: v / steps for d, v in totals["host_device"].items()},
            # Messages this rank sent to each rank of another node (`platform.ledger`), by kind.
            "crossing_messages": {style: {str(peer): count / steps for peer, count in by_peer.items()}
                                  for style, by_peer in totals["crossing_messages"].items()},
            # Bytes of the collectives a labelled model issued (a reference model's forwards, `platform.ledger`).
            "by_model": _by_model(totals["by_model"], steps),
            "by_flow": {name: {key: v[key] / steps for key in
                               ("intra_node", "inter_node", "intra_node_scales", "inter_node_scales")}
                        for name, v in totals["by_flow"].items()}}


_MODEL_KEYS = ("intra_node", "inter_node", "link_bytes")


def _by_model(by_model: dict, steps: int = 1, *more: dict) -> dict:
    """A ledger summary's ``by_model`` per step, with the ``by_model`` of `more` summaries added."""
    names = set(by_model).union(*more)
    return {name: {key: sum(part.get(name, {}).get(key, 0.0) for part in (by_model, *more)) / steps
                   for key in _MODEL_KEYS} for name in names}


class StepRecorder:
    """Per optimizer step of one rank: `begin_step` before its first micro-step, `before_last_step` just before
    the last optimizer step's ``engine.step()`` (memory of model states: stock hpZ drops its secondary shards in
    the step), `end_step` after its boundary ``engine.step()``; then `finish` once.

    `barrier` (a callable, or None) aligns the ranks around each step when node-link counters are read: a node's
    counter sums what all its ranks sent, so a rank still in the previous step would move bytes between steps.
    It runs outside the timed and ledger windows."""

    def __init__(self, engine, *, steps: int, warmup_steps: int, node_size: int, rank: int, world: int,
                 read_link_counter: bool = False, barrier=None, link_topology: str = SHARED):
        self.engine = engine
        self.total_steps = steps
        self.rank, self.world, self.node_size = rank, world, node_size
        self.steady_from = min(warmup_steps, steps - 1)
        # The step drawn in the report's timeline: a steady one, before the last (which also measures memory).
        self.timeline_step = max(0, steps - 2)
        self.timeline = None
        # On an emulated cluster, local rank 0 of each node reads its node link's transmit counter (visible inside
        # the node's namespace), or on rails each rank its own link's: what really crossed between nodes, headers
        # included.
        device = link_device(rank, node_size, link_topology) if read_link_counter else None
        self.link_name = None if device is None else f"node{rank // node_size}/{device}"
        self.link_counter = None if device is None else node_link_counter(device)
        # Frames sent, read with the bytes over the steady steps: each frame's headers are known, so the payload
        # is the bytes less the frames' headers, exactly, whatever the messages' sizes (`bench.plan_check`).
        self.packet_counter = None if device is None else node_link_counter(device, "packets")
        self._barrier = barrier if read_link_counter else None
        self._quiesce = getattr(engine.optimizer, "hzp_quiesce_params", None)
        self._chunks = boundary_chunks(engine)
        self._offload = bool(engine.zero_cpu_offload())
        self._boundary = None
        self.steps: list = []
        self._after_step = None     # the ledger's mark when the last step ended
        self._between = None
        self.model_states = None
        self.fp32_grad_bytes = None
        self._open = None

    @property
    def index(self) -> int:
        return len(self.steps)

    @property
    def in_step(self) -> bool:
        """Between `begin_step` and `end_step`."""
        return self._open is not None

    def _align(self) -> None:
        if self._barrier is not None:
            self._barrier()

    def _start_steady_total(self) -> None:
        """Bytes are totalled over the steady steps as a whole: a parameter refresh submitted at the end of a step
        crosses the link during the next one, so per-step windows split it by timing. The total starts at a quiet
        point outside any timed step, the end of the last warm-up step, so that it also holds what the script issues
        between steps (GRPO generates and runs its reference model before the policy's first forward), and ends at
        one (in `finish`). Without warm-up steps it starts at the first step's first forward, after whatever the
        script issued before it."""
        if self._quiesce is not None:
            self._quiesce()
        self._align()
        self._steady = (ledger.mark(), _read_int(self.link_counter) if self.link_counter else None,
                        _read_int(self.packet_counter) if self.packet_counter else None)

    def begin_step(self) -> None:
        if self.index == self.steady_from == 0:
            self._start_steady_total()
        self._align()
        mark = ledger.mark()
        # What the script issued on the training thread since the last step ended (a communication thread's late
        # work of the step before left out), recorded apart in the step's figures.
        self._between = (ledger.summary(self._after_step, mark, training_thread_only=True)
                         if self._after_step is not None else None)
        tx = _read_int(self.link_counter) if self.link_counter else None
        # CPU time of this rank's process (every thread of it): what the step cost the host, unlike wall time
        # barely moved by other load on a shared machine.
        self._open = (mark, tx, time.perf_counter(), time.process_time())
        self._boundary = None

    def boundary_begins(self) -> None:
        """The window's last backward has returned."""
        self._boundary = (time.perf_counter(), None)

    def boundary_ends(self) -> None:
        """The window's `engine.step()` has returned."""
        if self._boundary is not None:
            self._boundary = (self._boundary[0], time.perf_counter())

    def before_last_step(self) -> None:
        if self.index == self.total_steps - 1 and self.model_states is None:
            self.model_states = model_state_bytes(self.engine)
            self.fp32_grad_bytes = fp32_grad_bytes(self.engine)

    def end_step(self, loss: float) -> None:
        mark, tx_before, start, cpu_start = self._open
        self._open = None
        end = time.perf_counter()
        cpu_elapsed = time.process_time() - cpu_start
        comm = ledger.summary(mark)
        between = self._between or {}
        comm_ledger = ledger.get()
        boundary = None
        if self._boundary is not None and self._boundary[1] is not None:
            b_start, b_end = self._boundary
            phases = comm_ledger.boundary_phases_between(b_start, b_end)
            boundary = boundary_record(b_start, b_end, phases, self._chunks) if phases or self._offload else None
        if self.index == self.timeline_step:
            self.timeline = _timeline(comm_ledger, mark, start, end)
        self._align()
        tx_after = _read_int(self.link_counter) if self.link_counter else None
        self.steps.append({
            "link_bytes": comm["link_bytes"],
            "comm_s": comm["seconds"],
            # Time the training thread was blocked on communication, and time any collective was in flight.
            "exposed_comm_s": comm_ledger.exposed_seconds(start, end),
            "comm_busy_s": comm_ledger.busy_seconds(start, end, mark),
            "node_tx_bytes": tx_after - tx_before if self.link_counter else None,
            "loss": loss,
            "time_s": end - start,
            "cpu_s": cpu_elapsed,
            "intra_node": comm["intra_node"],
            "inter_node": comm["inter_node"],
            "calls": comm["calls"],
            "by_op": {op: {"intra_node": v["intra_node"], "inter_node": v["inter_node"], "calls": v["calls"]}
                      for op, v in comm["by_op"].items()},
            "by_family": {name: {"intra_node": v["intra_node"], "inter_node": v["inter_node"]}
                          for name, v in comm["by_family"].items()},
            # Labelled models' bytes (a reference model's forwards), from the end of the step before: GRPO runs its
            # reference model before the policy's first forward.
            "by_model": _by_model(comm["by_model"], 1, between.get("by_model", {})),
            # What the script issued on the training thread between the step before and this one's first forward
            # (the figures above count from that forward, as the times do).
            "between_steps": {key: between.get(key, 0) for key in ("intra_node", "inter_node", "calls")},
            # Under optimizer offload: the step boundary's wall time, phases and critical path (`measure.boundary`).
            "boundary": boundary,
        })
        self._after_step = ledger.mark()
        if self.index == self.steady_from:
            self._start_steady_total()

    def finish(self, ds_config: dict) -> dict:
        """The rank's record, after the last `end_step`; `ds_config` names the stock arm's layout."""
        if self._quiesce is not None:
            self._quiesce()
        self._align()
        optimizer = self.engine.optimizer
        # The package's own buffers beyond model states, as the measured steps left them (the pool's peak covers
        # every step); stock arms have none of them.
        buffers = staging = None
        if hasattr(optimizer, "hzp_buffer_bytes"):
            from ..runtime.buffer_bytes import staging_rings

            buffers, staging = optimizer.hzp_buffer_bytes(), staging_rings(optimizer)
        steady_steps = self.total_steps - self.steady_from
        steady_mark, steady_tx, steady_packets = self._steady
        steady = _per_step(ledger.summary(steady_mark), steady_steps)
        steady["node_tx_bytes"] = ((_read_int(self.link_counter) - steady_tx) / steady_steps
                                   if self.link_counter else None)
        steady["node_tx_packets"] = ((_read_int(self.packet_counter) - steady_packets) / steady_steps
                                     if self.packet_counter else None)
        layout, layout_text = layout_of(self.engine, ds_config, self.world, self.node_size)
        return {
            "rank": self.rank,
            "world_size": self.world,
            # The link whose transmit counter this rank read (node_tx_bytes), or None.
            "link": self.link_name,
            # Bytes per steady optimizer step, totalled over all steady steps (see begin_step).
            "steady_bytes_per_step": steady,
            "optimizer_class": type(optimizer).__name__,
            "host_optimizer_class": type(getattr(optimizer, "optimizer", None)).__name__,
            "steps": self.steps,
            "model_state_bytes": self.model_states,
            "fp32_grad_bytes": self.fp32_grad_bytes,
            "layout": layout,
            "layout_text": layout_text,
            "families": families_of(self.engine),
            "peak_rss_bytes": peak_rss_bytes(),
            "device": device_name(self.engine.device),
            "device_memory_peak_bytes": device_memory_peaks(self.engine.device),
            # Parameter tensors of the module (a tied one once): the divisor of host overhead per parameter.
            "parameter_tensors": sum(1 for _ in self.engine.module.parameters()),
            "timeline": self.timeline,
            "timeline_step": self.timeline_step,
            "buffer_allocations": (optimizer.hzp_buffer_allocations()
                                   if hasattr(optimizer, "hzp_buffer_allocations") else None),
            "package_buffer_bytes": buffers,
            "staging_rings": staging,
        }
