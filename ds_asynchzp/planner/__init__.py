"""Plan a cluster before training: model-state memory, bytes and communication time per optimizer step per arm.

Every number comes from the same code the engine and the tests use: traffic formulas from
:mod:`ds_asynchzp.traffic`, the memory model and the ``"auto"`` rule from :mod:`ds_asynchzp.sizing`, the layout
check from :func:`ds_asynchzp.config.resolve_layout`. This module only adds the two quantized arms, which the
engine does not run (ZeRO++ quantization is rejected together with ``async_hzp``):

``zeropp``: ZeRO++ with qwZ + hpZ + qgZ, as DeepSpeed implements it (``zero_quantized_weights``,
``zero_hpz_partition_size = G``, ``zero_quantized_gradients``). Per optimizer step, per rank::

    inter = q_w * P_g * (N-1)/N  +  A * q_g * P_r * (N-1)/N
    intra = (2A - 1) * q_w * P_g * (G-1)/G  +  A * q_g * P_r * (G-1)/G

    q_w = 1 byte (INT8), q_g = 0.5 byte (INT4)

The first forward after a step gathers INT8 weights over the world (0.5x of bf16); every later forward and
backward gather reads the hpZ secondary inside the node (DeepSpeed quantizes those gathers too). qgZ's first hop
is an INT4 all-to-all inside the node; its cross-node hop is counted as the ZeRO++ paper does, 0.25x of a bf16
reduce-scatter over the world. (The two-hop all-to-all moves only the node-reduced 1/G slice across nodes, so
this is the paper's upper figure.) This is :func:`ds_asynchzp.traffic.hpz_bytes` with b = q_w, b_c = q_g, plus
the intra-node hop.

``asynchzp-q``: AsyncHZP with the per-micro-step traffic quantized: INT8 parameter gathers over the d_p group and
INT4 gradient reduce-scatters over the d_g group. The once-per-step cross-node boundary gradient reduction (fp32)
and parameter refresh (b bytes) stay unquantized, so the inter-node bytes equal asynchzp's whenever d_p, d_g fit
in a node.

Quantization scales are left out (4 bytes per 8000-element group in DeepSpeed's weight quantizer: < 0.1 %).
Communication time = intra_bytes / intra_bw + inter_bytes / inter_bw: no overlap with compute or between the two
levels is assumed, so it is an upper bound of the exposed communication. Bandwidths are per rank.

Planned models are one tensor of Ψ elements padded to a multiple of the world, so P_g = P_r = P_t = Ψ_padded.
"""

from __future__ import annotations

import re
from dataclasses import replace

from . import sizing, traffic
from .config import resolve_layout

ARMS = ("zero3", "hpz", "zeropp", "asynchzp", "asynchzp-q")
ARM_DESCRIPTIONS = {
    "zero3": "stock ZeRO-3: params, grads, optimizer over the world",
    "hpz": "ZeRO++ hpZ: ZeRO-3 plus a secondary param partition per node",
    "zeropp": "ZeRO++ qwZ (INT8 weights) + hpZ + qgZ (INT4 grads)",
    "asynchzp": "AsyncHZP: params over d_p, grads over d_g, optimizer over the world",
    "asynchzp-q": "AsyncHZP, INT8 gathers and INT4 grad reduce-scatters inside the node",
}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
INT8_BYTES = 1.0
INT4_BYTES = 0.5

# --------------------------------------------------------------------------------------------- parsing
_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
# Rates are quoted in decimal units by NIC and link vendors (400 GB/s NVLink, 200 Gbit/s InfiniBand).
_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_BINARY = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_NUMBER = r"(?P<num>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)"
_UNIT = re.compile(r"(?P<prefix>[kKmMgGtTpP]?)(?P<binary>i?)(?P<base>bits?|bytes?|b|B)(?P<per>/s|/sec|ps)?",
                   re.IGNORECASE)


def parse_count(text: str) -> int:
    """A parameter count: ``7e9``, ``70B``, ``1.3M``, ``350k``, ``1_000_000`` (B/G = 10^9, T = 10^12)."""
    match = re.fullmatch(_NUMBER + r"\s*(?P<suffix>[kKmMbBgGtT]?)", str(text).strip().replace("_", "").replace(",", ""))
    if not match:
        raise ValueError(f"not a parameter count: {text!r} (examples: 7e9, 70B, 1.3M)")
    value = round(float(match["num"]) * _COUNT_SUFFIX[match["suffix"].upper()])
    if value < 1:
        raise ValueError(f"parameter count must be >= 1, got {text!r}")
    return value


def _split_unit(text: str, what: str, example: str) -> tuple[float, re.Match]:
    match = re.fullmatch(_NUMBER + r"\s*(?P<unit>\S+)", str(text).strip())
    unit = _UNIT.fullmatch(match["unit"]) if match else None
    if unit is None:
        raise ValueError(f"not a {what}: {text!r}; give a number and a unit, e.g. {example}")
    return float(match["num"]), unit


def _is_bits(base: str) -> bool:
    # "b" is a bit and "B" a byte (IEC/SI convention); spelled-out names are unambiguous in any case.
    return base == "b" or base.lower() in ("bit", "bits")


def parse_bandwidth(text: str) -> float:
    """Bytes per second from ``400GB/s``, ``200Gbit``, ``200Gbps``, ``100Gb/s``, ``25GiB/s``.

    ``B``/``byte`` are bytes and ``b``/``bit`` bits (divided by 8); prefixes are decimal (G = 10^9) unless written
    ``Ki``/``Mi``/``Gi``/``Ti``. The ``/s`` is optional.
    """
    number, unit = _split_unit(text, "bandwidth", "400GB/s or 200Gbit")
    scale = (_BINARY if unit["binary"] else _DECIMAL)[unit["prefix"].upper()]
    value = number * scale / (8 if _is_bits(unit["base"]) else 1)
    if value <= 0:
        raise ValueError(f"bandwidth must be > 0, got {text!r}")
    return value


def parse_memory(text: str) -> int:
    """Bytes from ``80GB``, ``64GiB``, ``40000MB``.

    Memory sizes use binary multiples for both ``GB`` and ``GiB`` (drivers and torch report device memory
    that way), the convention of ``async_hzp.memory_budget_gb`` (:data:`ds_asynchzp.sizing.BYTES_PER_GB`). Bits are rejected.
    """
    number, unit = _split_unit(text, "memory size", "80GB")
    if _is_bits(unit["base"]) or unit["per"]:
        raise ValueError(f"{text!r} is not a memory size in bytes; e.g. 80GB")
    value = int(number * _BINARY[unit["prefix"].upper()])
    if value <= 0:
        raise ValueError(f"memory size must be > 0, got {text!r}")
    return value


def params_from_model_spec(spec: dict) -> int:
    """Parameter count of a decoder-only transformer from ``{"layers", "hidden", "vocab", "ffn_hidden"?, "tied"?}``.

    Ψ ≈ L·(4h² + 2·h·f) + V·h·(1 if tied else 2), f = ffn_hidden (default 4h, which gives the usual 12·L·h²):
    attention q, k, v, o projections (4h²), a two-matrix MLP (2·h·f), the token embedding, and an output head
    unless it is tied to the embedding. Biases, norms and position tables (< 0.1 % at scale) are left out. For a
    gated MLP (SwiGLU: three h×f matrices) pass ffn_hidden = 1.5·f. ``tied`` defaults to false.
    """
    unknown = set(spec) - {"layers", "hidden", "vocab", "ffn_hidden", "tied"}
    if unknown:
        raise ValueError(f"model spec has unknown keys {sorted(unknown)}")
    try:
        layers, hidden, vocab = (int(spec[k]) for k in ("layers", "hidden", "vocab"))
    except KeyError as missing:
        raise ValueError(f"model spec lacks {missing}; it needs layers, hidden and vocab") from None
    ffn = int(spec.get("ffn_hidden") or 4 * hidden)
    if min(layers, hidden, vocab, ffn) < 1:
        raise ValueError(f"model spec sizes must be >= 1: {spec}")
    tied = spec.get("tied", False)
    if not isinstance(tied, bool):  # a string "false" would otherwise count as tied
        raise ValueError(f'model spec "tied" must be true or false, got {tied!r}')
    heads = 1 if tied else 2
    return layers * (4 * hidden * hidden + 2 * hidden * ffn) + heads * vocab * hidden


# ------------------------------------------------------------------------------------------ the arms
def zeropp_bytes(t: traffic.TrafficInputs) -> dict:
    """ZeRO++ qwZ + hpZ + qgZ (module docstring): hpZ's formula with INT8 weights and INT4 gradients, plus the
    intra-node all-to-all hop of qgZ."""
    quantized = traffic.hpz_bytes(replace(t, param_bytes=INT8_BYTES, grad_comm_bytes=INT4_BYTES))
    if t.world <= t.node_size:  # one node: hpZ's world reduction already is the only (intra-node) hop
        return quantized
    first_hop = t.grad_accum * INT4_BYTES * t.reduced_elements * (t.node_size - 1) / t.node_size
    return {"intra_node": quantized["intra_node"] + first_hop, "inter_node": quantized["inter_node"]}


def asynchzp_q_bytes(t: traffic.TrafficInputs, param_shard_size: int, grad_shard_size: int) -> dict:
    """AsyncHZP with quantized micro-step collectives and unquantized boundary collectives (module docstring).

    asynchzp_bytes is linear in the micro-step count, and its A = 0 value is the boundary traffic alone; so the
    quantized micro-steps are the INT8/INT4 run minus its own boundary, and no formula is restated here.
    """
    sizes = (param_shard_size, grad_shard_size)
    boundary = traffic.asynchzp_bytes(replace(t, grad_accum=0), *sizes)
    quantized = replace(t, param_bytes=INT8_BYTES, grad_comm_bytes=INT4_BYTES)
    quantized_all = traffic.asynchzp_bytes(quantized, *sizes)
    quantized_boundary = traffic.asynchzp_bytes(replace(quantized, grad_accum=0), *sizes)
    return {k: boundary[k] + quantized_all[k] - quantized_boundary[k] for k in boundary}


def arm_bytes(arm: str, t: traffic.TrafficInputs, d_p: int, d_g: int) -> dict:
    """Bytes per optimizer step per rank, ``{"intra_node", "inter_node"}``, of one arm."""
    if arm == "zero3":
        return traffic.zero3_bytes(t)
    if arm == "hpz":
        return traffic.hpz_bytes(t)
    if arm == "zeropp":
        return zeropp_bytes(t)
    if arm == "asynchzp":
        return traffic.asynchzp_bytes(t, d_p, d_g)
    if arm == "asynchzp-q":
        return asynchzp_q_bytes(t, d_p, d_g)
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")


def arm_memory(arm: str, num_params: int, world: int, node_size: int, d_p: int, d_g: int, param_bytes: int) -> dict:
    """Model-state bytes per rank, from :func:`ds_asynchzp.sizing.model_state_bytes_per_rank`.

    Stock ZeRO-3 has no working shard nor accumulation shard, so both roles are dropped; hpZ's secondary
    partition has the shape of a working shard over the node (``b·Ψ/G``, kept unquantized by DeepSpeed, also
    under qwZ). Quantized arms store the same states as their unquantized twins.
    """
    if arm in ("zero3", "hpz", "zeropp"):
        parts = sizing.model_state_bytes_per_rank(num_params, world, node_size, world, world, param_bytes=param_bytes)
        kept = {role: parts[role] for role in ("param_primary", "grad_primary", "master", "optimizer_state")}
        if arm != "zero3":
            kept["param_secondary"] = parts["param_shard"]
        kept["total"] = sum(kept.values())
        return kept
    if arm in ("asynchzp", "asynchzp-q"):
        return sizing.model_state_bytes_per_rank(num_params, world, d_p, d_g, world, param_bytes=param_bytes)
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")


# ------------------------------------------------------------------------------------------- planning
def traffic_inputs(num_params: int, world: int, node_size: int, grad_accum: int, dtype: str) -> traffic.TrafficInputs:
    """Inputs for a planned model: one padded tensor, every element gathered, reduced and trained."""
    padded = sizing.padded_num_params([num_params], world)
    b = DTYPE_BYTES[dtype]
    return traffic.TrafficInputs(world=world, node_size=node_size, grad_accum=grad_accum, gathered_elements=padded,
                                 reduced_elements=padded, trainable_elements=padded, param_bytes=b, grad_comm_bytes=b)


def auto_shard_sizes(padded_params: int, world: int, node_size: int, budget_bytes: float | None, dtype: str) -> dict:
    """What ``"auto"`` picks, from :func:`ds_asynchzp.sizing.choose_shard_sizes` (``error`` set if nothing fits)."""
    try:
        d_p, d_g, d_o = sizing.choose_shard_sizes(padded_params, world, node_size, budget_bytes,
                                                  param_bytes=DTYPE_BYTES[dtype])
    except ValueError as exc:  # AsyncHZPConfigError is a ValueError
        return {"d_p": None, "d_g": None, "d_o": world, "error": str(exc)}
    return {"d_p": d_p, "d_g": d_g, "d_o": d_o, "error": None}


def check_layout(world: int, node_size: int, d_p: int, d_g: int) -> None:
    """Raise the engine's own AsyncHZPConfigError when explicit sizes are not a valid layout."""
    section = {"node_size": node_size, "param_shard_size": d_p, "grad_shard_size": d_g}
    resolve_layout({"zero_optimization": {"stage": 3}, "async_hzp": section}, world, node_size,
                   has_client_optimizer=True)


def plan(num_params: int, world: int, node_size: int, grad_accum: int = 1, dtype: str = "bf16",
         intra_bw: float | None = None, inter_bw: float | None = None, device_memory: int | None = None,
         memory_budget: float | None = None, param_shard_size: int | str = "auto",
         grad_shard_size: int | str | None = None) -> dict:
    """The whole plan as a JSON-ready dict: inputs, the ``"auto"`` pick, and per arm memory, bytes and time.

    Budget for ``"auto"``: ``memory_budget`` if given, else ``sizing.DEFAULT_BUDGET_FRACTION`` of
    ``device_memory`` (what the engine's default gives on such a device), else ``sizing.default_budget_bytes``
    of this machine. ``grad_shard_size=None`` follows ``param_shard_size`` as in the engine's config.
    """
    if world < 1 or node_size < 1 or world % node_size:
        raise ValueError(f"node size {node_size} must be >= 1 and divide the world size {world}")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    t = traffic_inputs(num_params, world, node_size, grad_accum, dtype)
    padded, b = t.trainable_elements, t.param_bytes

    if memory_budget is not None:
        budget, budget_source = float(memory_budget), "given"
    elif device_memory is not None:
        budget = device_memory * sizing.DEFAULT_BUDGET_FRACTION
        budget_source = f"{sizing.DEFAULT_BUDGET_FRACTION:.0%} of device memory"
    else:
        budget, budget_source = float(sizing.default_budget_bytes(node_size)), "detected on this machine"
    auto = auto_shard_sizes(padded, world, node_size, budget, dtype)
    auto.update(budget_bytes=budget, budget_source=budget_source)

    grad_shard_size = param_shard_size if grad_shard_size is None else grad_shard_size
    if "auto" in (param_shard_size, grad_shard_size):
        if param_shard_size != grad_shard_size:
            raise ValueError('"auto" chooses both shard sizes together; give both as integers or leave both "auto"')
        # Nothing fits: plan the widest in-node layout, which the memory columns then flag.
        d_p, d_g = (auto["d_p"], auto["d_g"]) if auto["error"] is None else (node_size, node_size)
        layout_source = "auto" if auto["error"] is None else "node size (auto found no fit)"
    else:
        d_p, d_g = int(param_shard_size), int(grad_shard_size)
        check_layout(world, node_size, d_p, d_g)
        layout_source = "given"

    arms = {}
    for arm in ARMS:
        memory = arm_memory(arm, padded, world, node_size, d_p, d_g, b)
        moved = arm_bytes(arm, t, d_p, d_g)
        times = None
        if intra_bw and inter_bw:
            intra_s, inter_s = moved["intra_node"] / intra_bw, moved["inter_node"] / inter_bw
            times = {"intra_node": intra_s, "inter_node": inter_s, "total": intra_s + inter_s}
        arms[arm] = {
            "description": ARM_DESCRIPTIONS[arm],
            "model_state_bytes": memory,
            "fits_device_memory": None if device_memory is None else memory["total"] <= device_memory,
            "bytes_per_step": moved,
            "comm_time_s": times,
        }
    return {
        "inputs": {"params": num_params, "padded_params": padded, "world": world, "node_size": node_size,
                   "nodes": world // node_size, "grad_accum": grad_accum, "dtype": dtype, "param_bytes": b,
                   "grad_comm_bytes": b, "intra_bw_bytes_per_s": intra_bw, "inter_bw_bytes_per_s": inter_bw,
                   "device_memory_bytes": device_memory},
        "auto": auto,
        "layout": {"d_p": d_p, "d_g": d_g, "d_o": world, "source": layout_source},
        "arms": arms,
        "assumptions": [
            "ring model bytes sent per rank per optimizer step; scalar all-reduces left out",
            "comm time = intra/intra_bw + inter/inter_bw, bandwidths per rank, no overlap with compute",
            "zeropp: INT8 weight gathers, hpZ secondary per node, INT4 grads; cross-node grads 0.25x of bf16",
            "asynchzp-q: INT8 gathers and INT4 reduce-scatters per micro-step; boundary reduction and refresh "
            "unquantized",
            "memory: model states only (no activations, buffers, fragmentation)",
        ],
    }


# ------------------------------------------------------------------- checking a benchmark run (--check)
CHECKED_ARMS = ("zero3", "hpz", "asynchzp")
CHECK_RTOL = 0.05  # relative to the predicted bytes
ZERO_PREDICTION_SLACK_BYTES = 1024  # where nothing is predicted, a few scalar all-reduces may still show up
# Link counters of an emulated network see whole frames, both directions' TCP acknowledgements included; the
# ledger and the formulas count payload. Per full segment of MSS = MTU - 52 payload bytes (20 IPv4 + 32 TCP with
# timestamps) a frame adds 52 bytes plus a 14-byte Ethernet header on veth (none on the relay's TUN devices);
# the receiver acknowledges every second segment with a header-only frame. At MTU 1500 on veth that is
# 1514/1448 + 66/2896 = 1.068 (a 4 MiB all-reduce measured 1.065); at MTU 9000, 1.011.
TCP_IP_HEADER_BYTES = 52
ETHERNET_HEADER_BYTES = 14


def wire_overhead_factor(mtu: int = 1500, ethernet: bool = True) -> float:
    mss = mtu - TCP_IP_HEADER_BYTES
    frame_header = TCP_IP_HEADER_BYTES + (ETHERNET_HEADER_BYTES if ethernet else 0)
    return (mss + frame_header) / mss + frame_header / (2 * mss)


WIRE_OVERHEAD_FACTOR = wire_overhead_factor(1500)


def _padded(numel: int, world: int) -> int:
    return sizing.padded_num_params([numel], world)


def bench_element_counts(config: dict) -> dict:
    """P_g, P_r, P_t of the benchmark's model, counted as the ledger tests count them.

    P_g: each module's own parameters (a tied weight once per module that owns it); P_r: trainable parameters
    except the deliberately unused one; P_t: all trainable parameters. Each padded to a multiple of the world.
    """
    from .bench.model import build_model
    from .bench.worker import _model_config  # the exact architecture the benchmark's ranks built

    world = int(config.get("world_size") or config["nproc"])
    model = build_model(_model_config(config["model"], int(config.get("moe_experts") or 0),
                                      int(config.get("seq_len") or 0)))
    counts = {"gathered": 0, "reduced": 0, "trainable": 0}
    for module in model.modules():
        counts["gathered"] += sum(_padded(p.numel(), world) for p in module.parameters(recurse=False))
    for name, param in model.named_parameters():
        if param.requires_grad:
            counts["trainable"] += _padded(param.numel(), world)
            if name != "unused":
                counts["reduced"] += _padded(param.numel(), world)
    return counts


def _asynchzp_sizes(results: dict, node_size: int) -> tuple[int, int]:
    """(d_p, d_g) the asynchzp arm ran with: its reported layout, else its config override, else the defaults."""
    entry = results.get("arms", {}).get("asynchzp", {})
    layout = entry.get("layout") or {}
    d_p, d_g = layout.get("d_p"), layout.get("d_g")
    if d_p is None:
        override = results.get("config", {}).get("arm_overrides", {}).get("asynchzp", {}).get("async_hzp", {})
        d_p, d_g = override.get("param_shard_size"), override.get("grad_shard_size")
    d_p = node_size if d_p is None else d_p
    d_g = d_p if d_g is None else d_g
    if not (isinstance(d_p, int) and isinstance(d_g, int)):
        raise ValueError(f"asynchzp arm ran with shard sizes {d_p!r}/{d_g!r} and results.json does not say what "
                         "they resolved to; give integer sizes to the benchmark")
    return d_p, d_g


def _compare(arm: str, quantity: str, predicted: float, measured: float) -> dict:
    if predicted == 0:
        ok, rel = measured < ZERO_PREDICTION_SLACK_BYTES, None
    else:
        rel = (measured - predicted) / predicted
        ok = abs(rel) <= CHECK_RTOL
    return {"arm": arm, "quantity": quantity, "predicted": predicted, "measured": measured, "rel_diff": rel, "ok": ok}


def _overhead_of(config: dict) -> float:
    network = config.get("network") or {}
    relay = network.get("inter_node_delay_ms") not in (None, 0, "0")
    return wire_overhead_factor(int(network.get("mtu") or 1500), ethernet=not relay)


def check_results(results: dict) -> dict:
    """Predicted vs measured bytes per step for each known arm of an ``asynchzp-bench`` results.json."""
    config = results["config"]
    world = int(config.get("world_size") or config["nproc"])
    node_size, dtype = int(config["node_size"]), config.get("dtype", "fp32")
    elements = results.get("elements") or config.get("elements") or bench_element_counts(config)
    b = DTYPE_BYTES[dtype]
    t = traffic.TrafficInputs(world=world, node_size=node_size, grad_accum=int(config["grad_accum"]),
                              gathered_elements=elements["gathered"], reduced_elements=elements["reduced"],
                              trainable_elements=elements["trainable"], param_bytes=b, grad_comm_bytes=b)
    rows, notes, d_p, d_g = [], [], None, None
    for arm, entry in results.get("arms", {}).items():
        if arm not in CHECKED_ARMS:
            notes.append(f"arm {arm!r} has no formula here; not checked")
            continue
        if arm == "asynchzp":
            d_p, d_g = _asynchzp_sizes(results, node_size)
        predicted = arm_bytes(arm, t, d_p, d_g)
        for where in ("intra_node", "inter_node"):
            rows.append(_compare(arm, where, predicted[where], float(entry["bytes_per_step"][where])))
        # Node links carry only the ring edges between nodes (traffic.link_bytes), not the whole inter-node
        # ring-model figure: predicted once, compared with the ledger's own estimate and with the link counters.
        link = traffic.link_bytes(arm, t, d_p, d_g)
        if entry.get("link_bytes_inter_node_per_step") is not None:
            rows.append(_compare(arm, "inter_node_link", link, float(entry["link_bytes_inter_node_per_step"])))
        wire = entry.get("wire_bytes_inter_node_per_step")
        if wire is not None:
            rows.append(_compare(arm, "inter_node_wire", link, float(wire) / _overhead_of(config)))
    if not rows:
        notes.append("no arm of results.json could be checked")
    return {"ok": bool(rows) and all(r["ok"] for r in rows), "rows": rows, "notes": notes,
            "elements": {k: elements[k] for k in ("gathered", "reduced", "trainable")},
            "inputs": {"world": world, "node_size": node_size, "grad_accum": t.grad_accum, "dtype": dtype},
            "asynchzp_layout": None if d_p is None else {"d_p": d_p, "d_g": d_g},
            "wire_overhead_factor": _overhead_of(config)}
