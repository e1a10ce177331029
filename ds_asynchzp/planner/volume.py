"""ZeRO++'s volume table, per optimizer step and per rank: the cross-node bytes of each flow of a step (forward
gather, backward gather, gradient reduction, and AsyncHZP's once-per-step parameter refresh), predicted for every
arm, next to the figures ZeRO++ publishes.

ZeRO++ (arXiv 2306.10209) counts, per iteration with M the model in fp16: ZeRO-3 M + M + M = 3M, ZeRO++
0.5M (qwZ, INT8) + 0 (hpZ) + 0.25M (qgZ, INT4) = 0.75M. With A micro-steps per optimizer step hpZ and qwZ cross
nodes on the first forward after a step only; everything else repeats every micro-step.

What stock DeepSpeed 0.19.8's qgZ sends differs from the published 0.25M: its all-to-all has two hops, and the
cross-node hop moves only the node-reduced slice, 1/G of the INT4 gradient (G ranks per node); tensors it cannot
split (1-D ones, and those whose size is not a multiple of 2N) fall back to a full-precision reduce-scatter over
the world. `zeropp_flows` predicts what the implementation sends; `published_flows` what the paper counts.
Quantization scales are left out (qwZ: 4 bytes per group of up to 16000 values; qgZ: one fp32 scale per row or
column, 8/min(rows, cols) of the INT4 payload: 2 % at width 384).
"""

from __future__ import annotations

from ..formulas import flows as F
from ..formulas import traffic

INT8_BYTES = traffic.ZEROPP_INT8_BYTES
INT4_BYTES = traffic.ZEROPP_INT4_BYTES
_ring = traffic._ring
TABLE_FLOWS = (F.FORWARD_GATHER, F.BACKWARD_GATHER, F.GRADIENT_REDUCTION, F.PARAMETER_REFRESH)


def zero3_flows(t: traffic.TrafficInputs) -> dict:
    """A reference model's gathers (`TrafficInputs.reference_models`) run in its forward."""
    gather = t.grad_accum * t.param_bytes * t.gathered_elements * _ring(t.world)
    return {F.FORWARD_GATHER: (1 + t.reference_models) * gather, F.BACKWARD_GATHER: gather,
            F.GRADIENT_REDUCTION: t.grad_accum * t.grad_comm_bytes * t.reduced_elements * _ring(t.world),
            F.PARAMETER_REFRESH: 0.0}


def hpz_flows(t: traffic.TrafficInputs, weight_bytes: float | None = None) -> dict:
    """The first forward after a step gathers the trainable parameters over the world; the rest read the
    node's secondary partition, as do a reference model's (its copy never goes stale)."""
    b = t.param_bytes if weight_bytes is None else weight_bytes
    return {F.FORWARD_GATHER: b * t.trainable_elements * _ring(t.world), F.BACKWARD_GATHER: 0.0,
            F.GRADIENT_REDUCTION: t.grad_accum * t.grad_comm_bytes * t.reduced_elements * _ring(t.world),
            F.PARAMETER_REFRESH: 0.0}


def zeropp_flows(t: traffic.TrafficInputs, quantizable_elements: int | None = None) -> dict:
    """hpZ + qwZ + qgZ as stock DeepSpeed sends it. `quantizable_elements`: the part of P_r that qgZ's two-hop
    all-to-all takes (2-D, size a multiple of 2N; default all of it); the rest is reduce-scattered over the
    world in the communication dtype."""
    out = hpz_flows(t, weight_bytes=INT8_BYTES)
    if t.world <= t.node_size:
        return out
    q = t.reduced_elements if quantizable_elements is None else quantizable_elements
    nodes = t.world // t.node_size
    two_hop = traffic.zeropp_qgz_hop_bytes(q, t.node_size, nodes)
    fallback = t.grad_comm_bytes * (t.reduced_elements - q) * _ring(t.world)
    out[F.GRADIENT_REDUCTION] = t.grad_accum * (two_hop + fallback)
    return out


def published_flows(arm: str, t: traffic.TrafficInputs) -> dict | None:
    """ZeRO++'s published accounting for zero3 and zeropp (None for other arms): M per flow for ZeRO-3; 0.5M
    (once per step), 0 and 0.25M for ZeRO++, in the run's element counts."""
    if arm == "zero3":
        return zero3_flows(t)
    if arm == "zeropp":
        out = hpz_flows(t, weight_bytes=INT8_BYTES)
        out[F.GRADIENT_REDUCTION] = t.grad_accum * INT4_BYTES * t.reduced_elements * _ring(t.world)
        return out
    return None


def asynchzp_table_flows(t: traffic.TrafficInputs, d_p: int, d_g: int, d_o: int, quantization) -> dict:
    """AsyncHZP's flows (`traffic.asynchzp_flows`) in the table's terms; its gathers are split evenly between
    forward and backward (the same parameters, once each); a reference model's are in the forward."""
    flows = {name: v["inter_node"] for name, v in traffic.asynchzp_flows(t, d_p, d_g, d_o, quantization).items()}
    return {F.FORWARD_GATHER: flows["param_gather"] / 2 + flows["reference_gather"],
            F.BACKWARD_GATHER: flows["param_gather"] / 2,
            F.GRADIENT_REDUCTION: flows["grad_reduce_scatter"] + flows["boundary_grad"] + flows["boundary_allreduce"],
            F.PARAMETER_REFRESH: flows["param_refresh"] + flows["persistent_regather"]}


def arm_flows(arm: str, t: traffic.TrafficInputs, d_p: int | None = None, d_g: int | None = None,
              d_o: int | None = None, quantization=None) -> dict:
    """Predicted cross-node bytes per rank per optimizer step of each flow of `TABLE_FLOWS`, for any arm the
    planner knows (an ``asynchzp...`` arm with its layout and quantization plan; an offload arm with its
    twin's, `traffic.offload_twin`)."""
    twin = traffic.offload_twin(arm)
    if twin == "zero3":
        return zero3_flows(t)
    if twin == "hpz":
        return hpz_flows(t)
    if twin == "zeropp":
        return zeropp_flows(t, t.qgz_elements)
    if twin.startswith("asynchzp"):
        return asynchzp_table_flows(t, d_p, d_g, t.world if d_o is None else d_o, quantization)
    raise ValueError(f"no flow formulas for arm {arm!r}")
