"""The collectives each arm issues in one optimizer step, as `formulas.links.Collective` records (op, groups,
bytes, count), so that `formulas.links` can place their bytes on the links of any topology.

They are the collectives behind the per-rank formulas of `formulas.traffic` (same symbols, same element counts):
summing (k-1)/k * S per member over these records gives those formulas' bytes (a test checks it).

    zero3    all-gather of b*P_g over the world, 2A times (forward, backward); reduce-scatter of b_c*P_r, A times
    hpz      all-gather of b*P_t over the world once (the first gather after a step), then all-gathers of
             b*(2A*P_g - P_t) from the secondary partition inside each node; reduce-scatter as zero3
    zeropp   hpz with INT8 weights; qgZ per micro-step: an INT4 all-to-all of Q inside each node, then an INT4
             all-to-all of the node-reduced Q/G among the ranks of the same local index (one per node); the
             reduced elements qgZ cannot split reduce-scattered over the world in b_c
    reference each reference model's forward (R of them): an all-gather of b*P_g, A times, over the world for
             zero3, inside each node for hpz and zeropp (hpZ's secondary, in the arm's weight bytes), over d_r
             for asynchzp (`traffic.reference_group_size`: the world where the config keeps stock's engine)
    asynchzp one record per flow of `traffic.FLOWS` over the layout's groups; a quantized flow moves its wire
             format's bytes, a quantized reduction as an all-to-all, a quantized all-reduce as an all-to-all plus
             an all-gather (both of the quantized slice)
"""

from __future__ import annotations

from functools import lru_cache

from ..layout import HierarchicalLayout
from ..quantization import NO_QUANTIZATION, QuantizationPlan
from . import traffic
from .links import Collective, Topology, link_load

ZEROPP_INT8_BYTES = traffic.ZEROPP_INT8_BYTES
ZEROPP_INT4_BYTES = traffic.ZEROPP_INT4_BYTES


@lru_cache(maxsize=256)
def _world(n: int) -> tuple:
    return (tuple(range(n)),)


@lru_cache(maxsize=256)
def _nodes(n: int, g: int) -> tuple:
    return tuple(tuple(range(s, s + g)) for s in range(0, n, g))


@lru_cache(maxsize=256)
def _rails(n: int, g: int) -> tuple:
    """Ranks of the same local index, one per node."""
    return tuple(tuple(range(i, n, g)) for i in range(g))


@lru_cache(maxsize=4096)
def _flow_groups(flow: str, n: int, d_p: int, d_g: int, d_o: int, reference_copies: bool = True) -> tuple:
    return tuple(tuple(grp) for grp in traffic.flow_groups(flow, n, d_p, d_g, d_o, reference_copies))


def _reference(t: traffic.TrafficInputs, groups: tuple, weight_bytes: float) -> list:
    """The reference models' forward gathers (none without reference models)."""
    if not t.reference_models:
        return []
    return [Collective("all_gather", groups, weight_bytes * t.gathered_elements, t.grad_accum * t.reference_models,
                       "reference_gather")]


def zero3(t: traffic.TrafficInputs) -> list:
    world = _world(t.world)
    return [Collective("all_gather", world, t.param_bytes * t.gathered_elements, 2 * t.grad_accum, "param_gather"),
            Collective("reduce_scatter", world, t.grad_comm_bytes * t.reduced_elements, t.grad_accum,
                       "grad_reduce_scatter")] + _reference(t, world, t.param_bytes)


def hpz(t: traffic.TrafficInputs, weight_bytes: float | None = None) -> list:
    b = t.param_bytes if weight_bytes is None else weight_bytes
    world, nodes = _world(t.world), _nodes(t.world, t.node_size)
    secondary = (2 * t.grad_accum * t.gathered_elements - t.trainable_elements) * b
    return [Collective("all_gather", world, b * t.trainable_elements, 1, "param_gather"),
            Collective("all_gather", nodes, secondary, 1, "secondary_gather"),
            Collective("reduce_scatter", world, t.grad_comm_bytes * t.reduced_elements, t.grad_accum,
                       "grad_reduce_scatter")] + _reference(t, nodes, b)


def zeropp(t: traffic.TrafficInputs) -> list:
    out = hpz(t, weight_bytes=ZEROPP_INT8_BYTES)[:2] + _reference(t, _nodes(t.world, t.node_size), ZEROPP_INT8_BYTES)
    n, g, a = t.world, t.node_size, t.grad_accum
    q = t.reduced_elements if t.qgz_elements is None else t.qgz_elements
    out.append(Collective("all_to_all", _nodes(n, g), ZEROPP_INT4_BYTES * q, a, "qgz_intra"))
    if n > g:
        out.append(Collective("all_to_all", _rails(n, g), ZEROPP_INT4_BYTES * q / g, a, "qgz_inter"))
    out.append(Collective("reduce_scatter", _world(n), t.grad_comm_bytes * (t.reduced_elements - q), a,
                          "grad_reduce_scatter"))
    return out


def asynchzp(t: traffic.TrafficInputs, d_p: int, d_g: int, d_o: int | None = None,
             quantization: QuantizationPlan = NO_QUANTIZATION) -> list:
    n, a = t.world, t.grad_accum
    d_o = n if d_o is None else d_o
    HierarchicalLayout(n, t.node_size, d_p, d_g, d_o)   # raises ValueError naming the sizes
    b, b_c, p_t = t.param_bytes, t.grad_comm_bytes, t.trainable_elements

    def groups(flow: str) -> tuple:
        return _flow_groups(flow, n, d_p, d_g, d_o, t.reference_copies)

    def wire(flow: str, plain: float) -> tuple:
        fmt = quantization.format_of(flow)
        return (plain, False) if fmt is None else (fmt.bytes_per_value(), True)

    out = []
    gather_b, _ = wire("param_gather", b)
    out.append(Collective("all_gather", groups("param_gather"), gather_b * t.gathered_elements, 2 * a,
                          "param_gather"))
    rs_b, quantized = wire("grad_reduce_scatter", b_c)
    out.append(Collective("all_to_all" if quantized else "reduce_scatter", groups("grad_reduce_scatter"),
                          rs_b * t.reduced_elements, a, "grad_reduce_scatter"))
    bg_b, _ = wire("boundary_grad", b_c)
    out.append(Collective("all_to_all", groups("boundary_grad"), bg_b * p_t / d_g, 1, "boundary_grad"))
    ar_b, quantized = wire("boundary_allreduce", b_c)
    if quantized:
        out += [Collective("all_to_all", groups("boundary_allreduce"), ar_b * p_t / d_o, 1, "boundary_allreduce"),
                Collective("all_gather", groups("boundary_allreduce"), ar_b * p_t / d_o, 1, "boundary_allreduce")]
    else:
        out.append(Collective("all_reduce", groups("boundary_allreduce"), ar_b * p_t / d_o, 1, "boundary_allreduce"))
    refresh_b, _ = wire("param_refresh", b)
    out.append(Collective("all_gather", groups("param_refresh"), refresh_b * p_t / d_p, 1, "param_refresh"))
    out.append(Collective("all_gather", groups("persistent_regather"), b * t.persistent_elements, 1,
                          "persistent_regather"))
    return out + _reference(t, groups("reference_gather"), b)


def arm_collectives(arm: str, t: traffic.TrafficInputs, d_p: int | None = None, d_g: int | None = None,
                    d_o: int | None = None, quantization: QuantizationPlan = NO_QUANTIZATION) -> list:
    """The collectives of ``arm`` per optimizer step (an offload arm: its twin's, `traffic.offload_twin`). For an
    ``asynchzp...`` arm ``d_p`` defaults to the node size, ``d_g`` to ``d_p``, ``d_o`` to the world."""
    twin = traffic.offload_twin(arm)
    if twin == "zero3":
        return zero3(t)
    if twin == "hpz":
        return hpz(t)
    if twin == "zeropp":
        return zeropp(t)
    if twin.startswith("asynchzp"):
        d_p = t.node_size if d_p is None else d_p
        return asynchzp(t, d_p, d_p if d_g is None else d_g, d_o, quantization)
    raise ValueError(f"no collectives known for arm {arm!r}")


def remapped(collectives, rank_of) -> list:
    """The same collectives with every group member ``i`` replaced by ``rank_of(i)`` (a sub-world's indices to
    global ranks); ``rank_of`` may return several ranks for one index (one per copy of the sub-world), given as
    a list of functions."""
    out = []
    for c in collectives:
        groups = tuple(tuple(f(i) for i in grp) for f in rank_of for grp in c.groups)
        out.append(Collective(c.op, groups, c.size, c.count, c.flow))
    return out


def link_bytes(arm: str, t: traffic.TrafficInputs, param_shard_size: int | None = None,
               grad_shard_size: int | None = None, optimizer_shard_size: int | None = None,
               quantization: QuantizationPlan = NO_QUANTIZATION) -> float:
    """Bytes per rank per optimizer step that leave through node links on the emulated cluster (payload only):
    the arm's collectives as gloo runs them (rings in rank order, its reduce-scatter an all-reduce) over one
    link per node, summed over the links and divided by the world. The ledger records the same per collective;
    the emulator's counters measure it."""
    collectives = arm_collectives(arm, t, param_shard_size, grad_shard_size, optimizer_shard_size, quantization)
    load = link_load(collectives, Topology(t.world, t.node_size, 1, "gloo"))
    return sum(map(sum, load.nic)) / t.world
