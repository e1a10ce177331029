"""Analytic bytes per optimizer step, per rank, intra- vs inter-node, for each arm.

Same ring model as the communication ledger (all-gather / reduce-scatter of a total S over n ranks sends
(n-1)/n * S per rank; all-reduce twice that; point-to-point S, by the sender). A group counts as
inter-node when it spans more than one node. Symbols (docs/ARCHITECTURE.md, "Traffic"):

    N world, G ranks per node, A micro-steps per optimizer step, k_p / k_g param / grad shard sizes
    b  bytes of a parameter element, b_c bytes of a gradient element on the wire (communication dtype)
    P_g  padded elements gathered per pass: each module's own parameters, padded to a multiple of N (ZeRO-3
         fetches them when the module runs, so a weight shared by two modules counts twice)
    P_r  padded elements reduced per micro-step (parameters that receive a gradient)
    P_t  padded trainable elements (the optimizer's partitions; includes parameters without a gradient)

ZeRO-3 with persistence thresholds 0 gathers each parameter once in forward and once in backward:
    inter = A * (2 * b * P_g + b_c * P_r) * (N-1)/N                                    intra = 0
ZeRO++ hpZ (secondary group G): the step drops the secondary shards of trainable parameters, so the first
gather of each after a step goes over the world; every other gather (a tied weight's second use, frozen
parameters, backward) uses the intra-node secondary:
    inter = (b * P_t + A * b_c * P_r) * (N-1)/N        intra = (2A * P_g - P_t) * b * (G-1)/G
AsyncHZP (m_x = N / k_x replicas):
    intra = A * (2 * b * P_g * (k_p-1)/k_p + b_c * P_r * (k_g-1)/k_g)
    inter = 4 * P_t / k_g * (m_g-1)/m_g + f_g * 4 * P_t / N          (boundary gradient reduction)
          + b * P_t / k_p * (m_p-1)/m_p + f_p * b * P_t / N          (parameter shard refresh)
    where f_x is the fraction of ranks whose permutation peer sits on another node (exact, from the grid);
    the fraction whose peer is on the same node sends its partition over intra-node links.
Each arm also all-reduces a few scalars per step (gradient norm, overflow flag); they are below 0.01 % of any
figure here and left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rank_grid import ShardLayout


@dataclass(frozen=True)
class TrafficInputs:
    world: int
    node_size: int
    grad_accum: int
    gathered_elements: int       # P_g (per module use)
    reduced_elements: int        # P_r
    trainable_elements: int      # P_t
    param_bytes: int = 4         # b
    grad_comm_bytes: int = 4     # b_c


def permutation_fractions(layout: ShardLayout, node_size: int, inverse: bool = False) -> tuple:
    """(intra, inter): fractions of ranks whose permutation send stays in / leaves the node.

    A rank that keeps its own slice sends nothing and counts in neither.
    """
    intra = inter = 0
    for rank in range(layout.world):
        peer = layout.rank_holding_slice_role_of(rank) if inverse else layout.primary_slice_for(rank)
        if peer != rank:
            if peer // node_size == rank // node_size:
                intra += 1
            else:
                inter += 1
    return intra / layout.world, inter / layout.world


def _ring(n: int) -> float:
    return (n - 1) / n


def zero3_bytes(t: TrafficInputs) -> dict:
    per_micro = 2 * t.param_bytes * t.gathered_elements + t.grad_comm_bytes * t.reduced_elements
    inter = t.grad_accum * per_micro * _ring(t.world)
    return _split(t, intra=0.0, inter=inter)


def hpz_bytes(t: TrafficInputs) -> dict:
    inter = (t.param_bytes * t.trainable_elements + t.grad_accum * t.grad_comm_bytes * t.reduced_elements) * _ring(t.world)
    intra = (2 * t.grad_accum * t.gathered_elements - t.trainable_elements) * t.param_bytes * _ring(t.node_size)
    return _split(t, intra=intra, inter=inter)


def asynchzp_bytes(t: TrafficInputs, param_shard_size: int, grad_shard_size: int) -> dict:
    param_layout, grad_layout = ShardLayout(t.world, param_shard_size), ShardLayout(t.world, grad_shard_size)
    gathers = t.grad_accum * 2 * t.param_bytes * t.gathered_elements * _ring(param_shard_size)
    reduces = t.grad_accum * t.grad_comm_bytes * t.reduced_elements * _ring(grad_shard_size)
    grad_intra, grad_inter = permutation_fractions(grad_layout, t.node_size)
    param_intra, param_inter = permutation_fractions(param_layout, t.node_size, inverse=True)
    grad_partition, param_partition = 4 * t.trainable_elements / t.world, t.param_bytes * t.trainable_elements / t.world
    intra = grad_intra * grad_partition + param_intra * param_partition
    inter = (4 * t.trainable_elements / grad_shard_size * _ring(grad_layout.replicas) + grad_inter * grad_partition
             + t.param_bytes * t.trainable_elements / param_shard_size * _ring(param_layout.replicas)
             + param_inter * param_partition)
    # A shard group wider than a node carries its per-micro-step traffic over inter-node links.
    if param_shard_size > t.node_size:
        inter += gathers
    else:
        intra += gathers
    if grad_shard_size > t.node_size:
        inter += reduces
    else:
        intra += reduces
    return _split(t, intra=intra, inter=inter)


def _split(t: TrafficInputs, intra: float, inter: float) -> dict:
    if t.world <= t.node_size:  # one node: no group can span nodes
        return {"intra_node": intra + inter, "inter_node": 0.0}
    return {"intra_node": intra, "inter_node": inter}


# ------------------------------------------------------------------------------------- node-link bytes
# What the node links of a real (or emulated) cluster carry, per rank, when the backend runs every collective
# as a ring in rank order, as gloo does: only ring edges between two nodes put bytes on a link, and gloo's
# reduce-scatter is an all-reduce underneath (two ring passes). A group of n ranks spread evenly over s nodes
# has s such edges (s >= 2), so a fraction s/n of its members send over a link, (n-1)/n * S each per pass.
# The ledger records the same per collective (`link_bytes`); the emulator's link counters measure it.
GLOO_REDUCE_SCATTER_PASSES = 2


def _link_fraction(group_size: int, nodes_spanned: int) -> float:
    return nodes_spanned / group_size if nodes_spanned >= 2 else 0.0


def _nodes_spanned_by_shard_group(k: int, node_size: int) -> int:
    return max(1, k // node_size)


def _nodes_spanned_by_replica_group(k: int, world: int, node_size: int) -> int:
    return min(world // k, world // node_size)


def link_bytes(arm: str, t: TrafficInputs, param_shard_size: int = None, grad_shard_size: int = None) -> float:
    """Bytes per rank per optimizer step over node links (payload only; see module notes)."""
    n, g, a = t.world, t.node_size, t.grad_accum
    nodes = n // g
    rs = GLOO_REDUCE_SCATTER_PASSES
    world_fraction = _link_fraction(n, nodes) * _ring(n)
    if arm == "zero3":
        return a * (2 * t.param_bytes * t.gathered_elements + rs * t.grad_comm_bytes * t.reduced_elements) * world_fraction
    if arm == "hpz":
        return (t.param_bytes * t.trainable_elements + a * rs * t.grad_comm_bytes * t.reduced_elements) * world_fraction
    if arm != "asynchzp":
        raise ValueError(f"no node-link formula for arm {arm!r}")
    kp, kg = param_shard_size, grad_shard_size
    mp, mg = n // kp, n // kg

    def shard(k: int) -> float:
        return _link_fraction(k, _nodes_spanned_by_shard_group(k, g)) * _ring(k)

    def replica(k: int, m: int) -> float:
        return _link_fraction(m, _nodes_spanned_by_replica_group(k, n, g)) * _ring(m) if m > 1 else 0.0

    _, grad_inter = permutation_fractions(ShardLayout(n, kg), g)
    _, param_inter = permutation_fractions(ShardLayout(n, kp), g, inverse=True)
    micro = a * (2 * t.param_bytes * t.gathered_elements * shard(kp) + rs * t.grad_comm_bytes * t.reduced_elements * shard(kg))
    boundary = rs * 4 * t.trainable_elements / kg * replica(kg, mg) + grad_inter * 4 * t.trainable_elements / n
    refresh = t.param_bytes * t.trainable_elements / kp * replica(kp, mp) + param_inter * t.param_bytes * t.trainable_elements / n
    return micro + boundary + refresh
