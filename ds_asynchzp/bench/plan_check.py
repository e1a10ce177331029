"""The planner's figures against what a benchmark run recorded: ``asynchzp-plan --check``.

`check_results`: predicted against measured bytes per optimizer step of every arm of an ``asynchzp-bench``
results.json (the planner's formulas, `planner.arm_formulas` and `planner.volume`, with the layout each arm ran
and the elements of the benchmark's model, `models.presets`), and against the link counters of an emulated
network (frame headers and acknowledgements taken off, `wire_overhead_factor`). `check_sweep`: the planner's
step-time model (`planner.time_model`) against a bandwidth sweep's measured step times.

Above the planner: it reads the benchmark's records; the planner knows nothing of them.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..formulas import links, step_collectives, traffic
from ..planner import volume
from ..planner.arm_formulas import DTYPE_BYTES, arm_bytes, arm_quantization
from ..planner.time_model import cross_node_share, link_seconds, predicted_step_s, step_bounds_s
from ..quantization import NO_QUANTIZATION
from .records import read_results

CHECKED_ARMS = ("zero3", "hpz", "zeropp", "asynchzp")  # and every arm named asynchzp..., and their -offload twins
CHECK_RTOL = 0.05  # relative to the predicted bytes
TIME_RTOL = 0.20  # predicted step time against the measured one, relative
ZERO_PREDICTION_SLACK_BYTES = 1024  # where nothing is predicted, a few scalar all-reduces may still show up
# A link the model leaves idle still carries frames of the collectives it leaves out (gradient norms, overflow
# flags, the recorder's barriers; gloo runs small ones in patterns other than its rings): 1.6 KB per step on the
# idle rails of 2 nodes of 4. It fails only well above that.
IDLE_LINK_SLACK_BYTES = 16 * 1024
# Link counters of an emulated network see whole frames, both directions' TCP acknowledgements included; the
# ledger and the formulas count payload. Every frame carries 52 bytes of IPv4 and TCP headers (timestamps on),
# plus a 14-byte Ethernet header on veth (none on the relay's TUN devices); an acknowledgement is headers only.
# Where the run counted frames, the payload is exactly the bytes less each frame's headers (`counted_payload`),
# whatever the messages' sizes: a small message ends in a partial frame, so a fixed factor undercounts the
# headers of many small messages (ZeRO++'s quantized gathers: +7 % to +20 %). Older records have no frame
# count; for them, full frames are assumed: per segment of MSS = MTU - 52 payload bytes one frame, and one
# acknowledgement per second segment. At MTU 1500 on veth that is 1514/1448 + 66/2896 = 1.068; at 9000, 1.011.
TCP_IP_HEADER_BYTES = 52
ETHERNET_HEADER_BYTES = 14
# Gloo adds control bytes to every message it sends (an operation header, and notifications between the two
# ranks on the same connection), the same for every message size. Measured on the emulated cluster (2 nodes of 2,
# 200 calls each of 4 KiB, 64 KiB and 1 MiB, headers off by frame count): a ring step's message (all-gather,
# all-reduce, reduce-scatter) 289 B on the two nodes' links together, an all-to-all's message 146 B, a
# point-to-point send 100 B on the sender's link and 52 B back on the receiver's. Split as that send is: (on the
# link the message leaves by, on the receiver's link of the same rail). Counted messages come from the ledger
# (`crossing_messages_per_step`); they matter for many small calls (ZeRO++'s quantized gathers), not for big ones.
GLOO_CONTROL_BYTES = {"ring": (190.0, 99.0), "pairwise": (96.0, 50.0)}


def frame_header_bytes(ethernet: bool = True) -> int:
    return TCP_IP_HEADER_BYTES + (ETHERNET_HEADER_BYTES if ethernet else 0)


def wire_overhead_factor(mtu: int = 1500, ethernet: bool = True) -> float:
    mss = mtu - TCP_IP_HEADER_BYTES
    frame_header = frame_header_bytes(ethernet)
    return (mss + frame_header) / mss + frame_header / (2 * mss)


WIRE_OVERHEAD_FACTOR = wire_overhead_factor(1500)


def bench_element_counts(config: dict, multiple: int | None = None) -> dict:
    """P_g, P_r, P_t of the benchmark's model of a results.json ``config``, counted as the ledger tests count
    them (`models.presets.element_counts`), padded to a multiple of ``multiple`` (default: the world)."""
    from ..models.presets import element_counts  # the exact architecture the benchmark's ranks built

    world = int(config.get("world_size") or config["nproc"])
    return element_counts(config["model"], int(config.get("moe_experts") or 0), int(config.get("seq_len") or 0),
                          world, multiple)


_LAYOUT_KEYS = {"d_p": ("param_shard_size", "d_p"), "d_g": ("grad_shard_size", "d_g"),
                "d_o": ("optimizer_shard_size", "d_o")}


def asynchzp_sizes(results: dict, arm: str, node_size: int, world: int) -> tuple[int, int, int]:
    """(d_p, d_g, d_o) an asynchzp arm ran with: the resolved layout its entry reports (``layout``:
    ``param_shard_size``, ...), else the integer sizes of its config override, else the defaults
    (``d_p = d_g = node_size``, ``d_o = world``)."""
    entry = results.get("arms", {}).get(arm, {})
    layout = entry.get("layout") or {}
    sizes = {k: next((layout[n] for n in names if layout.get(n) is not None), None)
             for k, names in _LAYOUT_KEYS.items()}
    if sizes["d_p"] is None:
        override = results.get("config", {}).get("arm_overrides", {}).get(arm, {}).get("async_hzp", {})
        sizes = {k: override.get(names[0]) for k, names in _LAYOUT_KEYS.items()}
        if "auto" in sizes.values():
            raise ValueError(f"arm {arm!r} ran with \"auto\" sizes and results.json does not say what they "
                             "resolved to (no layout in its entry); give integer sizes to the benchmark")
    d_p = node_size if sizes["d_p"] is None else sizes["d_p"]
    d_g = d_p if sizes["d_g"] is None else sizes["d_g"]
    d_o = world if sizes["d_o"] is None else sizes["d_o"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (d_p, d_g, d_o)):
        raise ValueError(f"arm {arm!r} reports shard sizes {d_p!r}/{d_g!r}/{d_o!r}, not integers")
    return d_p, d_g, d_o


def _compare(arm: str, quantity: str, predicted: float, measured: float,
             zero_slack: float = ZERO_PREDICTION_SLACK_BYTES) -> dict:
    if predicted == 0:
        ok, rel = measured < zero_slack, None
    else:
        rel = (measured - predicted) / predicted
        ok = abs(rel) <= CHECK_RTOL
    return {"arm": arm, "quantity": quantity, "predicted": predicted, "measured": measured, "rel_diff": rel, "ok": ok}


def _on_relay(config: dict) -> bool:
    return (config.get("network") or {}).get("inter_node_delay_ms") not in (None, 0, "0")


def _overhead_of(config: dict) -> float:
    network = config.get("network") or {}
    return wire_overhead_factor(int(network.get("mtu") or 1500), ethernet=not _on_relay(config))


def counted_payload(config: dict, frame_bytes: float, frames: float | None) -> float:
    """Payload bytes a link carried: its counted bytes less every counted frame's headers, or, without a frame
    count, divided by the full-frame factor."""
    if frames is None:
        return frame_bytes / _overhead_of(config)
    return frame_bytes - frames * frame_header_bytes(ethernet=not _on_relay(config))


def _is_checked(arm: str) -> bool:
    arm = traffic.offload_twin(arm)
    return arm in CHECKED_ARMS or arm.startswith("asynchzp")


def check_results(results: dict) -> dict:
    """Predicted vs measured bytes per step for each known arm of an ``asynchzp-bench`` results.json.

    Every arm whose name starts with ``asynchzp`` (``asynchzp``, ``asynchzp:optimizer_shard_size=4``, ...) is
    checked against the asynchzp formulas with its own layout (:func:`asynchzp_sizes`) and its elements padded
    to a multiple of its ``d_o``: the arm entry's ``elements`` if recorded, else the results' elements when
    ``d_o`` is the world, else counted from the benchmark's model. An offload arm (``zero3-offload``,
    ``asynchzp-offload``) is checked against its twin's formulas (`traffic.offload_twin`): offload adds copies
    between device and host, which no network counter sees, and changes no collective."""
    config = results["config"]
    if config.get("ep_size"):
        # The ledger splits such a run by family (`summary.md`); the formulas here are for one dense layout.
        raise ValueError(f"the results are of an MoE model ({config.get('model')!r}, ep {config['ep_size']}); "
                         "--check covers dense models only: compare its families table with "
                         "`asynchzp-plan --expert-params ... --ep-size ...` instead")
    world = int(config.get("world_size") or config["nproc"])
    node_size, dtype = int(config["node_size"]), config.get("dtype", "fp32")
    world_elements = results.get("elements") or config.get("elements")
    b = DTYPE_BYTES[dtype]

    def elements_for(entry: dict, multiple: int) -> dict:
        nonlocal world_elements
        if entry.get("elements"):
            return entry["elements"]
        if multiple != world:
            return bench_element_counts(config, multiple)
        if not world_elements:
            world_elements = bench_element_counts(config)
        return world_elements

    rows, notes, layouts, used, link_predictions, busiest_links = [], [], {}, None, {}, {}
    for arm, entry in results.get("arms", {}).items():
        if not _is_checked(arm):
            notes.append(f"arm {arm!r} has no formula here; not checked")
            continue
        twin = traffic.offload_twin(arm)
        d_p = d_g = d_o = None
        multiple = world
        if twin.startswith("asynchzp"):
            d_p, d_g, d_o = asynchzp_sizes(results, arm, node_size, world)
            layouts[arm] = {"d_p": d_p, "d_g": d_g, "d_o": d_o}
            multiple = d_o
        elements = elements_for(entry, multiple)
        used = used or elements
        t = traffic.TrafficInputs(world=world, node_size=node_size, grad_accum=int(config["grad_accum"]),
                                  gathered_elements=elements["gathered"], reduced_elements=elements["reduced"],
                                  trainable_elements=elements["trainable"], param_bytes=b, grad_comm_bytes=b,
                                  qgz_elements=elements.get("qgz") if twin == "zeropp" else None)
        quantization = (arm_quantization(arm, world, node_size, d_p, d_g, d_o, entry.get("layout"))
                        if twin.startswith("asynchzp") else NO_QUANTIZATION)
        predicted = arm_bytes(arm, t, d_p, d_g, d_o, quantization)
        for where in ("intra_node", "inter_node"):
            rows.append(_compare(arm, where, predicted[where], float(entry["bytes_per_step"][where])))
        # ZeRO++'s volume table: cross-node bytes of each flow (forward gather, backward gather, gradient
        # reduction, parameter refresh), where the run recorded them.
        measured_flows = entry.get("bytes_per_step_by_flow")
        if measured_flows:
            for flow, value in volume.arm_flows(arm, t, d_p, d_g, d_o, quantization).items():
                rows.append(_compare(arm, f"inter_node {flow}", value,
                                     float((measured_flows.get(flow) or {}).get("inter_node", 0.0))))
        # Node links carry only the ring edges between nodes, not the whole inter-node ring-model figure: the
        # model's bytes leaving each link (gloo's rings on the run's topology), compared link by link with the
        # counters below, and per rank (their sum over the world, `step_collectives.link_bytes`, whatever the
        # topology) with the ledger's own estimate and with the counters' total.
        per_link = link_loads(config, arm, t, d_p, d_g, d_o, quantization)
        link = sum(per_link.values()) / world
        link_predictions[arm] = link
        if entry.get("link_bytes_inter_node_per_step") is not None:
            rows.append(_compare(arm, "inter_node_link", link, float(entry["link_bytes_inter_node_per_step"])))
        # What the counters see is the payload plus gloo's control bytes of the messages the ledger counted.
        control = control_link_loads(config, entry.get("crossing_messages_per_step"))
        on_wire = {name: value + control.get(name, 0.0) for name, value in per_link.items()}
        counted_links = entry.get("wire_bytes_by_link_per_step") or {}
        frames = entry.get("wire_packets_by_link_per_step")
        payloads = {name: counted_payload(config, float(counted), None if frames is None else float(frames[name]))
                    for name, counted in counted_links.items()}
        wire = entry.get("wire_bytes_inter_node_per_step")
        if frames is not None and payloads:   # per rank, from the links' payloads
            rows.append(_compare(arm, "inter_node_wire", sum(on_wire.values()) / world, sum(payloads.values()) / world))
        elif wire is not None:
            rows.append(_compare(arm, "inter_node_wire", sum(on_wire.values()) / world,
                                 counted_payload(config, float(wire), None)))
        busiest_links[arm] = max(per_link.values())
        for name, payload in sorted(payloads.items()):
            if name in on_wire:
                rows.append(_compare(arm, f"link {name}", on_wire[name], payload, IDLE_LINK_SLACK_BYTES))
    if not rows:
        notes.append("no arm of results.json could be checked")
    elements = world_elements or used or {"gathered": 0, "reduced": 0, "trainable": 0}
    return {"ok": bool(rows) and all(r["ok"] for r in rows), "rows": rows, "notes": notes,
            "elements": {k: elements[k] for k in ("gathered", "reduced", "trainable")},
            "inputs": {"world": world, "node_size": node_size, "grad_accum": int(config["grad_accum"]),
                       "dtype": dtype, "topology": run_topology(config)},
            "asynchzp_layouts": layouts, "wire_overhead_factor": _overhead_of(config),
            "frame_header_bytes": frame_header_bytes(ethernet=not _on_relay(config)),
            "control_counted": any(e.get("crossing_messages_per_step") for e in results.get("arms", {}).values()),
            "frames_counted": any(e.get("wire_packets_by_link_per_step") for e in results.get("arms", {}).values()),
            "link_bytes_per_rank": link_predictions, "busiest_link_bytes": busiest_links}


def control_link_loads(config: dict, crossing: dict | None) -> dict:
    """``{"node<i>/eth<k>": bytes per optimizer step}`` of gloo's control bytes (`GLOO_CONTROL_BYTES`) for the
    run's messages between nodes (``{"ring" | "pairwise": {"src>dst": count}}``), on the links their payload
    takes: out of the sender's node on the receiver's rail (rails) or its one link, and the answers back out of
    the receiver's node on that rail."""
    topology = emulated_topology(config)
    loads: dict = {}
    for style, pairs in (crossing or {}).items():
        out_bytes, back_bytes = GLOO_CONTROL_BYTES[style]
        for key, count in pairs.items():
            src, dst = (int(r) for r in key.split(">"))
            rail = topology.nic_of(dst)
            for node, per_message in ((topology.node_of(src), out_bytes), (topology.node_of(dst), back_bytes)):
                name = f"node{node}/eth{rail}"
                loads[name] = loads.get(name, 0.0) + count * per_message
    return loads


def run_topology(config: dict) -> str:
    """The emulated topology a results.json ran on: "rails" or "shared" (the only one before rails existed)."""
    return ((config.get("network") or {}).get("topology")) or "shared"


def emulated_topology(config: dict) -> links.Topology:
    """The links model of the emulated network a results.json ran on: gloo, one link per node or per rank."""
    world, node_size = int(config.get("world_size") or config["nproc"]), int(config["node_size"])
    return links.Topology(world, node_size, node_size if run_topology(config) == "rails" else 1, "gloo")


def link_loads(config: dict, arm: str, t: traffic.TrafficInputs, d_p, d_g, d_o, quantization) -> dict:
    """``{"node<i>/eth<k>": bytes per optimizer step}`` leaving each emulated link, by `formulas.links` with gloo's
    rings on the run's topology (one link per node, or one per rank on rails)."""
    load = links.link_load(step_collectives.arm_collectives(arm, t, d_p, d_g, d_o, quantization),
                           emulated_topology(config))
    return {f"node{node}/eth{k}": value for node, nics in enumerate(load.nic) for k, value in enumerate(nics)}


# ------------------------------------------------------------ checking a bandwidth sweep's step times
def load_sweep(path: Path) -> dict:
    """A bandwidth sweep's sweep.json (`asynchzp-bench --inter-node-bw A,B,...`) with every rate's results.json
    read in (``results[rate]``)."""
    sweep = json.loads(Path(path).read_text(encoding="utf-8"))
    base = Path(path).parent
    sweep["results"] = {rate: read_results(base / rel) for rate, rel in sweep["runs"].items()}
    return sweep


def check_sweep(sweep: dict) -> dict:
    """Predicted against measured median step time of every arm at every shaped rate of a bandwidth sweep
    (`load_sweep`), from the arm's unshaped step time; bytes from the planner's link formulas."""
    from ..netem import parse_rate

    rows, notes = [], []
    results = sweep["results"]
    unshaped = next((rate for rate in results if parse_rate(rate) is None), None)
    if unshaped is None:
        notes.append("the sweep has no unshaped rate ('unlimited'): the model's compute time is unknown; "
                     "step times not checked")
        return {"ok": False, "rows": rows, "notes": notes}
    base = results[unshaped]
    for rate, res in results.items():
        bits = parse_rate(rate)
        if bits is None:
            continue
        config = res["config"]
        checked = check_results(res)
        predicted_links, overhead = checked["link_bytes_per_rank"], checked["wire_overhead_factor"]
        for arm, entry in res["arms"].items():
            unshaped_entry = base["arms"].get(arm) or {}
            t0 = unshaped_entry.get("median_step_time_s")
            # The unshaped run's own link bytes where it recorded them: it calibrates the model (its compute
            # time is an input already), and it holds what the knobs change (a live-parameter cache that keeps
            # the last blocks of the forward for the backward sends less than the formulas count).
            link_bytes = unshaped_entry.get("link_bytes_inter_node_per_step", predicted_links.get(arm))
            if t0 is None or link_bytes is None or entry.get("median_step_time_s") is None:
                notes.append(f"{rate} {arm}: no unshaped run or no link bytes; not checked")
                continue
            overrides = (config.get("arm_overrides") or {}).get(arm, {}).get("async_hzp")
            if run_topology(config) == "rails":   # the busiest rank's own link
                link_s = link_seconds(float(checked["busiest_link_bytes"][arm]), 1, bits, overhead)
            else:
                link_s = link_seconds(float(link_bytes), int(config["node_size"]), bits, overhead)
            inputs = (arm, t0, link_s, int(config["grad_accum"]), overrides,
                      unshaped_entry.get("exposed_comm_s_per_step") or 0.0,
                      cross_node_share(unshaped_entry.get("timeline")))
            predicted, (low, high) = predicted_step_s(*inputs), step_bounds_s(*inputs)
            measured = entry["median_step_time_s"]
            rel = (measured - predicted) / predicted
            rows.append({"rate": rate, "arm": arm, "measured": measured, "predicted": predicted,
                         "low": low, "high": high, "link_s": link_s, "unshaped_s": t0, "rel_diff": rel,
                         "ok": abs(rel) <= TIME_RTOL})
    return {"ok": bool(rows) and all(r["ok"] for r in rows), "rows": rows, "notes": notes}
