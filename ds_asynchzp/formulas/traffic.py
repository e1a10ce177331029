"""Analytic bytes per optimizer step, per rank, intra- vs inter-node, for each arm.

Same ring model as the communication ledger: an all-gather, reduce-scatter or pairwise exchange (all-to-all)
of a total S over n ranks sends (n-1)/n * S per rank; an all-reduce twice that. A collective is inter-node
when its group spans more than one node (rank r lives on node r // G). Symbols (docs/ARCHITECTURE.md,
"Traffic"):

    N world, G ranks per node, A micro-steps per optimizer step, d_p | d_g | d_o | N the shard sizes
    T_p = d_o/d_p, T_g = d_o/d_g, R_o = N/d_o
    b  bytes of a parameter element, b_c bytes of a gradient element on the wire (communication dtype)
    P_g  padded elements gathered per pass: each module's own parameters (ZeRO-3 fetches them when the module
         runs, so a weight shared by two modules counts twice)
    P_r  padded elements reduced per micro-step (parameters that receive a gradient)
    P_t  padded trainable elements (the optimizer's partitions; includes parameters without a gradient)
    R    reference models: engines without an optimizer, each the trained model's size (P_g per forward), that
         run one forward per micro-step (a DPO reference model); `async_hzp.reference_models`
    Padding is per parameter, to a multiple of N for ZeRO-3 and hpZ, of d_o for AsyncHZP (its partition group).

ZeRO-3 with persistence thresholds 0 gathers each parameter once in forward and once in backward, and each
reference model's once per micro-step:
    inter = A * ((2 + R) * b * P_g + b_c * P_r) * (N-1)/N                              intra = 0
ZeRO++ hpZ (secondary group G): the step drops the secondary shards of trainable parameters, so the first
gather of each after a step goes over the world; every other gather (a tied weight's second use, frozen
parameters, backward, a reference model's, whose copy never goes stale) uses the intra-node secondary:
    inter = (b * P_t + A * b_c * P_r) * (N-1)/N        intra = ((2 + R) * A * P_g - P_t) * b * (G-1)/G
AsyncHZP, one figure per flow (`asynchzp_flows`); no point-to-point permutation exists:
    param_gather          A * 2 * b * P_g * (d_p-1)/d_p          d_p consecutive ranks, every micro-step
    grad_reduce_scatter   A * b_c * P_r * (d_g-1)/d_g            d_g consecutive ranks, every micro-step
    boundary_grad         b_c * P_t/d_g * (T_g-1)/T_g            {h*d_o + k*d_g + i : k}, once per step
    boundary_allreduce    2 * b_c * P_t/d_o * (R_o-1)/R_o        {h*d_o + q : h}, once per step (0 if d_o = N)
    param_refresh         b * P_t/d_p * (T_p-1)/T_p              {h*d_o + t*d_p + j : t}, once per step
    persistent_regather   b * P_persist * (d_p-1)/d_p            d_p consecutive ranks, once per step
    reference_gather      A * R * b * P_g * (d_r-1)/d_r          d_r consecutive ranks, every micro-step
A reference model's engine keeps its world partition and gets hpZ's copy over d_r = d_p inside the node
(`runtime/api.py`), where 1 < d_p < N and the config allows it (not under sequence parallelism, AutoEP, ZeRO++'s
quantized weights or all-reduce fetches: `TrafficInputs.reference_copies`); otherwise it is stock's and d_r = N. Its gathers are counted from the
second optimizer step on: the first forward of a model that zero.Init did not build still reads the world.
Quantized flows (`ds_asynchzp.quantization.QuantizationPlan`) use the same formulas with the element bytes of
their wire format, q = bits/8 + 4/block (values plus one fp32 scale per block) instead of b or b_c: a quantized
gradient reduction is a pairwise exchange of quantized rows ((n-1)/n * S, like a reduce-scatter), a quantized
all-reduce a quantized exchange plus a quantized all-gather (2(n-1)/n * S, like an all-reduce).
Each flow's bytes count as inter-node for the ranks whose group spans nodes (for every valid layout either all
groups of a kind span nodes or none do, except optimizer groups not aligned with nodes, where the split is the
exact share of ranks). Each arm also all-reduces a few scalars per step (gradient norm, overflow flag); they
are below 0.01 % of any figure here and left out.

Optimizer offload (``zero_optimization.offload_optimizer.device: "cpu"``) adds one flow of its own,
``host_device`` (:data:`HOST_DEVICE`): bytes a rank copies between its device and its host per optimizer step,
over PCIe rather than any network link, so they are neither intra- nor inter-node and are reported apart, as
``{"to_host", "to_device", "total"}`` (`host_device_bytes`; the ledger's ``summary()["host_device"]`` measures
the same two directions). With ``a`` the bytes of a gradient
accumulation element and 4 those of the fp32 gradient the host optimizer reads:

    stock ZeRO-3, hpZ, ZeRO++   D2H  A * a * P_r/N  +  4 * P_r/N       H2D  A * a * P_r/N  +  b * P_t/N
    AsyncHZP                    D2H  4 * P_r/d_o                       H2D  b * P_t/d_o

Stock DeepSpeed 0.19.8 keeps its gradient partitions on the host: every micro-step each reduced partition goes
to the host and back (the first micro-step copies it out and returns it to the device; later ones bring the
host buffer over, add, and copy the sum back); at the boundary its fp32 conversion of the reduced partitions
goes to the host, and after the step the updated parameters of every trainable partition come back in the
parameter dtype (the blocking copy converts on the host). AsyncHZP keeps its gradient shard on the device and
sends only its own atoms' fp32 gradients of the parameters that were reduced, once per step, then takes back
the updated parameters of all its trainable atoms: independent of ``A``. In both, a trainable parameter that
receives no gradient (P_t - P_r) has no gradient to copy out (the host keeps the fp32 gradient of the last
time it was copied) but is stepped and copied back like the others.

An arm ``BASE-offload`` (:func:`offload_twin`) is ``BASE`` with offload: offload leaves every network flow
unchanged, so its network formulas are ``BASE``'s, and its ``host_device`` flow is ``BASE``'s under offload.

Pure arithmetic: nothing here imports torch, DeepSpeed or the runtime (the groups come from `ds_asynchzp.layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..layout import HierarchicalLayout
from ..quantization import NO_QUANTIZATION, QuantizationPlan


@dataclass(frozen=True)
class TrafficInputs:
    world: int
    node_size: int
    grad_accum: int
    gathered_elements: int       # P_g (per module use)
    reduced_elements: int        # P_r
    trainable_elements: int      # P_t
    param_bytes: float = 4       # b
    grad_comm_bytes: float = 4   # b_c
    persistent_elements: int = 0  # P_persist: parameters kept gathered (ZeRO-3 persistence threshold), re-gathered once per step
    qgz_elements: int | None = None  # part of P_r stock ZeRO++'s qgZ all-to-all takes (2-D, a multiple of 2N); None: all
    reference_models: int = 0    # R: forward-only models of P_g elements each, one forward per micro-step
    # Whether AsyncHZP gives their engines hpZ's copy over d_p (False where the config keeps stock's engine:
    # `config_compat.reference_copy_refusal`, e.g. sequence parallelism or AutoEP).
    reference_copies: bool = True


#: The AsyncHZP flows, in the order of a step.
FLOWS = ("param_gather", "grad_reduce_scatter", "boundary_grad", "boundary_allreduce", "param_refresh",
         "persistent_regather", "reference_gather")
#: The host<->device flow of optimizer offload (module docstring); not a network flow, so not in `FLOWS`.
HOST_DEVICE = "host_device"
#: Bytes per element of the fp32 gradient copied to the host optimizer under offload.
HOST_GRAD_BYTES = 4
#: The name suffix of an arm that is another arm with its optimizer states on the host (``zero3-offload``,
#: ``asynchzp-offload``; see :func:`offload_twin`).
OFFLOAD_SUFFIX = "-offload"


def offload_twin(arm: str) -> str:
    """The arm whose formulas ``arm`` has: ``BASE[:overrides]`` for ``BASE-offload[:overrides]``, else ``arm``.

    Offload moves the optimizer states to the host and changes no collective, so an offload arm's network bytes
    are its twin's, and its placement and host<->device copies are its twin's with offload. Every lookup of an
    arm's formulas goes through here, so the name rule lives in one place. Overrides of a benchmark arm spec
    (``asynchzp-offload:param_shard_size=2``) are kept: they set the twin's layout just the same."""
    base, sep, overrides = arm.partition(":")
    return base.removesuffix(OFFLOAD_SUFFIX) + sep + overrides


def _ring(n: int) -> float:
    return (n - 1) / n


def reference_group_size(world: int, param_shard_size: int, copies: bool = True) -> int:
    """d_r: the ranks a reference model's forward gathers over under AsyncHZP: d_p where its engine gets hpZ's
    copy over d_p (1 < d_p < world and the config allows the copy, `runtime/api.py`), else the world (stock's
    engine)."""
    return param_shard_size if copies and 1 < param_shard_size < world else world


def zero3_bytes(t: TrafficInputs) -> dict:
    per_micro = (2 + t.reference_models) * t.param_bytes * t.gathered_elements + t.grad_comm_bytes * t.reduced_elements
    inter = t.grad_accum * per_micro * _ring(t.world)
    return _split(t, intra=0.0, inter=inter)


def hpz_bytes(t: TrafficInputs) -> dict:
    inter = (t.param_bytes * t.trainable_elements + t.grad_accum * t.grad_comm_bytes * t.reduced_elements) * _ring(t.world)
    gathers = (2 + t.reference_models) * t.grad_accum * t.gathered_elements - t.trainable_elements
    intra = gathers * t.param_bytes * _ring(t.node_size)
    return _split(t, intra=intra, inter=inter)


def _split(t: TrafficInputs, intra: float, inter: float) -> dict:
    if t.world <= t.node_size:  # one node: no group can span nodes
        return {"intra_node": intra + inter, "inter_node": 0.0}
    return {"intra_node": intra, "inter_node": inter}


# ------------------------------------------------------------------------------------ AsyncHZP groups
def _check_layout(n: int, g: int, d_p: int, d_g: int, d_o: int) -> None:
    HierarchicalLayout(n, g, d_p, d_g, d_o)  # raises ValueError naming the sizes


def flow_groups(flow: str, n: int, d_p: int, d_g: int, d_o: int, reference_copies: bool = True) -> list[list[int]]:
    """Every group of one flow (lists of ranks in ascending order, from `ds_asynchzp.layout`)."""
    reference_copies_group = reference_group_size(n, d_p, reference_copies)
    layout = HierarchicalLayout(n, 1, d_p, d_g, d_o)  # the groups do not depend on the node size
    groups = {
        "param_gather": layout.param_shard_groups, "persistent_regather": layout.param_shard_groups,
        "grad_reduce_scatter": layout.grad_shard_groups, "boundary_allreduce": layout.outer_replica_groups,
        "boundary_grad": layout.grad_boundary_groups, "param_refresh": layout.param_refresh_groups,
        # d_r consecutive ranks: the parameter shard groups of a layout whose d_p is d_r.
        "reference_gather": lambda: HierarchicalLayout(n, 1, *(reference_copies_group,) * 2, n).param_shard_groups(),
    }
    if flow not in groups:
        raise ValueError(f"unknown flow {flow!r}; known: {', '.join(FLOWS)}")
    return groups[flow]()


@lru_cache(maxsize=4096)
def _inter_share(flow: str, n: int, g: int, d_p: int, d_g: int, d_o: int, reference_copies: bool = True) -> float:
    """Share of ranks whose group of this flow spans more than one node (groups are sorted and equal-sized)."""
    groups = flow_groups(flow, n, d_p, d_g, d_o, reference_copies)
    return sum(1 for grp in groups if grp[0] // g != grp[-1] // g) / len(groups)


def asynchzp_flows(t: TrafficInputs, param_shard_size: int, grad_shard_size: int,
                   optimizer_shard_size: int | None = None,
                   quantization: QuantizationPlan = NO_QUANTIZATION) -> dict:
    """Ring-model bytes per rank per optimizer step of each AsyncHZP flow (module docstring), split into
    ``{"intra_node", "inter_node"}`` by whether the flow's group spans nodes (averaged over ranks).

    ``optimizer_shard_size`` defaults to the world. Element counts of ``t`` must be padded per parameter to a
    multiple of ``d_o`` (DeepSpeed's partition group). ``quantization`` gives the wire format of quantized
    flows (the engine's plan for this layout)."""
    n, g, a = t.world, t.node_size, t.grad_accum
    d_p, d_g = param_shard_size, grad_shard_size
    d_o = n if optimizer_shard_size is None else optimizer_shard_size
    _check_layout(n, g, d_p, d_g, d_o)
    t_p, t_g, r_o = d_o // d_p, d_o // d_g, n // d_o
    b, b_c, p_t = t.param_bytes, t.grad_comm_bytes, t.trainable_elements

    def element_bytes(flow: str, plain: float) -> float:
        fmt = quantization.format_of(flow)
        return plain if fmt is None else fmt.bytes_per_value()

    bytes_ = {
        "param_gather": a * 2 * element_bytes("param_gather", b) * t.gathered_elements * _ring(d_p),
        "grad_reduce_scatter": a * element_bytes("grad_reduce_scatter", b_c) * t.reduced_elements * _ring(d_g),
        "boundary_grad": element_bytes("boundary_grad", b_c) * p_t / d_g * _ring(t_g),
        "boundary_allreduce": 2 * element_bytes("boundary_allreduce", b_c) * p_t / d_o * _ring(r_o),
        "param_refresh": element_bytes("param_refresh", b) * p_t / d_p * _ring(t_p),
        "persistent_regather": b * t.persistent_elements * _ring(d_p),
        "reference_gather": a * t.reference_models * b * t.gathered_elements
                            * _ring(reference_group_size(n, d_p, t.reference_copies)),
    }
    out = {}
    for name in FLOWS:
        share = _inter_share(name, n, g, d_p, d_g, d_o, t.reference_copies) if bytes_[name] else 0.0
        out[name] = {"intra_node": bytes_[name] * (1 - share), "inter_node": bytes_[name] * share}
    return out


def asynchzp_bytes(t: TrafficInputs, param_shard_size: int, grad_shard_size: int,
                   optimizer_shard_size: int | None = None,
                   quantization: QuantizationPlan = NO_QUANTIZATION) -> dict:
    """``{"intra_node", "inter_node", "by_flow"}``: the AsyncHZP totals per rank per optimizer step, and
    ``by_flow[name] = {"intra_node", "inter_node"}`` for each of :data:`FLOWS` (see :func:`asynchzp_flows`)."""
    flows = asynchzp_flows(t, param_shard_size, grad_shard_size, optimizer_shard_size, quantization)
    return {"intra_node": sum(f["intra_node"] for f in flows.values()),
            "inter_node": sum(f["inter_node"] for f in flows.values()),
            "by_flow": flows}


# --------------------------------------------------------------------------------- host<->device (offload)
def _directions(d2h: float, h2d: float) -> dict:
    return {"to_host": d2h, "to_device": h2d, "total": d2h + h2d}


def stock_offload_host_device_bytes(t: TrafficInputs, grad_accum_bytes: float | None = None) -> dict:
    """Stock ZeRO-3's ``host_device`` bytes per rank per optimizer step under optimizer offload (also hpZ's and
    ZeRO++'s, whose gradient partitions follow the same path): to the host ``A·a·P_r/N + 4·P_r/N``, to the
    device ``A·a·P_r/N + b·P_t/N``; ``(2·a·A + 4 + b)·P/N`` in all with P_r = P_t = P. ``grad_accum_bytes``
    (``a``) defaults to the parameter bytes, DeepSpeed's default accumulation dtype.

    Only a partition that was reduced has a gradient to move: the per-micro-step round trip and the boundary's
    fp32 copy carry P_r. The updated parameters come back for every trainable partition the host stepped (P_t)."""
    a = t.param_bytes if grad_accum_bytes is None else grad_accum_bytes
    reduced, trainable = t.reduced_elements / t.world, t.trainable_elements / t.world
    return _directions(d2h=t.grad_accum * a * reduced + HOST_GRAD_BYTES * reduced,
                       h2d=t.grad_accum * a * reduced + t.param_bytes * trainable)


def asynchzp_host_device_bytes(t: TrafficInputs, optimizer_shard_size: int | None = None) -> dict:
    """AsyncHZP's ``host_device`` bytes per rank per optimizer step under optimizer offload, whatever ``A``:
    to the host ``4·P_r/d_o``, to the device ``b·P_t/d_o``. Elements of ``t`` padded to a multiple of ``d_o``
    (default: the world).

    The two directions differ in what they carry. Out go the fp32 gradients of the rank's own atoms of the
    parameters that were reduced (P_r): the runtime copies only the parameters stock's offload path would copy
    at the boundary (`runtime.host_offload`), and a trainable parameter that received no gradient has none to
    send. Back come the updated parameters of all its trainable atoms (P_t): the host optimizer steps every
    sub-group and each stepped one is copied into the parameter shard."""
    d_o = t.world if optimizer_shard_size is None else optimizer_shard_size
    if d_o < 1 or t.world % d_o:
        raise ValueError(f"optimizer_shard_size {d_o} must divide the world {t.world}")
    return _directions(d2h=HOST_GRAD_BYTES * t.reduced_elements / d_o,
                       h2d=t.param_bytes * t.trainable_elements / d_o)


def host_device_bytes(arm: str, t: TrafficInputs, optimizer_shard_size: int | None = None,
                      grad_accum_bytes: float | None = None) -> dict:
    """The ``host_device`` flow of an arm under optimizer offload: the stock formula for ``zero3``, ``hpz`` and
    ``zeropp``, AsyncHZP's (with its ``d_o``) for any arm named ``asynchzp...``, and its twin's for an offload
    arm (:func:`offload_twin`). Quantized arms copy the same bytes: quantization is a wire format of the network
    flows only."""
    twin = offload_twin(arm)
    if twin in ("zero3", "hpz", "zeropp"):
        return stock_offload_host_device_bytes(t, grad_accum_bytes)
    if twin.startswith("asynchzp"):
        return asynchzp_host_device_bytes(t, optimizer_shard_size)
    raise ValueError(f"no host<->device formula for arm {arm!r}")


# ------------------------------------------------------------------------------------- node-link bytes
# Stock ZeRO++'s wire formats (scales left out): qwZ's INT8 weights, qgZ's INT4 gradients.
ZEROPP_INT8_BYTES = 1.0
ZEROPP_INT4_BYTES = 0.5


def zeropp_qgz_hop_bytes(qgz_elements: float, node_size: int, nodes: int) -> float:
    """Stock qgZ's cross-node hop per micro-step: the node-reduced 1/G slice of the INT4 gradient, exchanged
    between one rank per node."""
    return ZEROPP_INT4_BYTES * qgz_elements / node_size * _ring(nodes) if nodes > 1 else 0.0
