"""The planner's arms: each one's bytes, model-state memory and quantization plan per optimizer step per rank.

Every number comes from the same code the engine and the tests use: traffic formulas from
:mod:`ds_asynchzp.formulas.traffic`, the memory model from :mod:`ds_asynchzp.formulas.sizing`, and the layout
(``"auto"`` included, with its reason) from :func:`ds_asynchzp.config.resolve_layout` itself. This module only
adds ZeRO++'s quantized arm, which the engine does not run (ZeRO++ quantization is rejected together with
``async_hzp``):

``zeropp``: ZeRO++ with qwZ + hpZ + qgZ, as DeepSpeed implements it (``zero_quantized_weights``,
``zero_hpz_partition_size = G``, ``zero_quantized_gradients``). Per optimizer step, per rank::

    inter = q_w * P_t * (N-1)/N  +  A * (q_g * Q / G * (N/G-1)/(N/G)  +  b_c * (P_r - Q) * (N-1)/N)
    intra = (2A * P_g - P_t) * q_w * (G-1)/G  +  A * q_g * Q * (G-1)/G

    q_w = 1 byte (INT8), q_g = 0.5 byte (INT4), Q = the part of P_r qgZ takes (2-D, a multiple of 2N)

The first forward after a step gathers INT8 weights over the world (0.5x of bf16); every later forward and
backward gather reads the hpZ secondary inside the node (DeepSpeed quantizes those gathers too). qgZ's first hop
is an INT4 all-to-all inside the node; its cross-node hop moves only the node-reduced 1/G slice, so it crosses
nodes far less than the 0.25x of a bf16 reduce-scatter that the ZeRO++ paper counts (`volume.published_flows`
keeps the paper's figure for the volume table); the tensors qgZ cannot split are reduce-scattered over the world
in the communication dtype. DeepSpeed's quantization scales are left out (4 bytes per group of up to 16000
values in its weight quantizer; one per row or column in qgZ: 8/min(rows, cols) of the INT4 payload).

The quantized AsyncHZP arms are what the engine runs with the ``async_hzp`` keys of `QUANTIZED_ARMS`
(``asynchzp-q``: ``quantize_cross_node``, the INT8 cross-node gradient exchange and parameter refresh): their
flows come from :func:`ds_asynchzp.quantization.plan_quantization`, the engine's own plan, with the wire bytes
of its format (values plus one fp32 scale per block).

Communication time = intra_bytes / intra_bw + inter_bytes / inter_bw: no overlap with compute or between the two
levels is assumed, so it is an upper bound of the exposed communication. Bandwidths are per rank.

Planned models are one tensor of Ψ elements, padded to a multiple of the world (to a multiple of d_o for the
asynchzp arms, as DeepSpeed pads over its partition group), so P_g = P_r = P_t = Ψ_padded.

Optimizer offload (``offload_optimizer``): "auto" budgets device bytes, and `planner.offload` adds each arm's device
and host bytes with and without offload and its host<->device bytes per step. An arm named ``BASE-offload`` (the
benchmark's ``zero3-offload``, ``asynchzp-offload``) has ``BASE``'s formulas (`traffic.offload_twin`).

`planner.cluster_plan` puts these together for a cluster (the ``"auto"`` pick, memory, bytes and time of every
arm); the inputs as people write them (``70B``, ``400GB/s``, ``80GB``, a model spec) are read by `planner.inputs`.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import AsyncHZPConfig
from ..formulas import sizing, step_collectives, traffic
from ..layout import HierarchicalLayout
from ..quantization import NO_QUANTIZATION, QuantizationPlan, plan_quantization
from . import volume

ARMS = ("zero3", "hpz", "zeropp", "asynchzp", "asynchzp-q")
ARM_DESCRIPTIONS = {
    "zero3": "stock ZeRO-3: params, grads, optimizer over the world",
    "hpz": "ZeRO++ hpZ: ZeRO-3 plus a secondary param partition per node",
    "zeropp": "ZeRO++ qwZ (INT8 weights) + hpZ + qgZ (INT4 grads)",
    "asynchzp": "AsyncHZP: params over d_p, grads over d_g, optimizer states over d_o",
    "asynchzp-q": "AsyncHZP, cross-node gradient exchange and parameter refresh in INT8",
}
# The async_hzp keys each quantized AsyncHZP arm sets (the benchmark's arms of the same names set the same).
QUANTIZED_ARMS = {
    "asynchzp-q": {"quantize_cross_node": True},
    "asynchzp-qw": {"quantized_weights": True},
    "asynchzp-qg": {"quantized_gradients": True},
}
QUANTIZATION_KEYS = ("quantized_weights", "quantized_gradients", "quantize_cross_node", "gradient_quantization_bits",
                     "quantization_block_size", "error_feedback")


def arm_quantization(arm: str, world: int, node_size: int, d_p: int, d_g: int, d_o: int | None = None,
                     keys: dict | None = None) -> QuantizationPlan:
    """The engine's quantization plan for an AsyncHZP arm: its `QUANTIZED_ARMS` keys (by base name, an offload
    arm's twin's), then ``keys`` (an arm's own section values), defaults for the rest."""
    base = traffic.offload_twin(arm).split(":")[0]
    values = {k: AsyncHZPConfig.model_fields[k].default for k in QUANTIZATION_KEYS}
    values.update(QUANTIZED_ARMS.get(base, {}))
    values.update({k: v for k, v in (keys or {}).items() if k in QUANTIZATION_KEYS and v is not None})
    layout = HierarchicalLayout(world, node_size, d_p, d_g, world if d_o is None else d_o)
    return plan_quantization(layout, values["quantized_weights"], values["quantized_gradients"],
                             values["quantize_cross_node"], values["gradient_quantization_bits"],
                             values["quantization_block_size"], values["error_feedback"])


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
INT8_BYTES = traffic.ZEROPP_INT8_BYTES
INT4_BYTES = traffic.ZEROPP_INT4_BYTES


def zeropp_bytes(t: traffic.TrafficInputs) -> dict:
    """ZeRO++ qwZ + hpZ + qgZ as stock DeepSpeed sends it (`volume.zeropp_flows`: INT8 weights once per step
    over the world, qgZ's cross-node hop only the node-reduced INT4 slice), plus its intra-node traffic: the
    secondary-partition gathers (INT8) and qgZ's first hop (an INT4 all-to-all inside the node)."""
    quantized = traffic.hpz_bytes(replace(t, param_bytes=INT8_BYTES, grad_comm_bytes=INT4_BYTES))
    if t.world <= t.node_size:  # one node: hpZ's world reduction already is the only (intra-node) hop
        return quantized
    q = t.reduced_elements if t.qgz_elements is None else t.qgz_elements
    first_hop = t.grad_accum * INT4_BYTES * q * (t.node_size - 1) / t.node_size
    inter = sum(volume.zeropp_flows(t, t.qgz_elements).values())
    return {"intra_node": quantized["intra_node"] + first_hop, "inter_node": inter}


def arm_bytes(arm: str, t: traffic.TrafficInputs, d_p: int, d_g: int, d_o: int | None = None,
              quantization: QuantizationPlan | None = None) -> dict:
    """Bytes per optimizer step per rank, ``{"intra_node", "inter_node"}`` (AsyncHZP arms add ``by_flow``).

    ``d_o`` defaults to the world. Any arm named ``asynchzp...`` (e.g. a benchmark arm
    ``asynchzp:optimizer_shard_size=4``) is the asynchzp formula with its own layout and its quantization plan
    (``quantization``, else :func:`arm_quantization` of the arm's name). An offload arm (``zero3-offload``,
    ``asynchzp-offload``) moves its twin's bytes (`traffic.offload_twin`): offload changes no collective."""
    twin = traffic.offload_twin(arm)
    if twin == "zero3":
        return traffic.zero3_bytes(t)
    if twin == "hpz":
        return traffic.hpz_bytes(t)
    if twin == "zeropp":
        return zeropp_bytes(t)
    if twin.startswith("asynchzp"):
        if quantization is None:
            quantization = arm_quantization(arm, t.world, t.node_size, d_p, d_g, d_o)
        return traffic.asynchzp_bytes(t, d_p, d_g, d_o, quantization)
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")


def arm_collectives(arm: str, t: traffic.TrafficInputs, d_p: int, d_g: int, d_o: int | None = None,
                    quantization: QuantizationPlan | None = None) -> list:
    """The collectives behind :func:`arm_bytes` (`formulas.step_collectives`), for `formulas.links` to place on
    the links of a topology; an AsyncHZP arm with its quantization plan (:func:`arm_quantization` by default)."""
    if traffic.offload_twin(arm).startswith("asynchzp") and quantization is None:
        quantization = arm_quantization(arm, t.world, t.node_size, d_p, d_g, d_o)
    return step_collectives.arm_collectives(arm, t, d_p, d_g, d_o, quantization or NO_QUANTIZATION)


def arm_memory(arm: str, num_params: int, world: int, node_size: int, d_p: int, d_g: int, param_bytes: int,
               d_o: int | None = None, grad_accum_bytes: int | None = None, reference_models: int = 0,
               reference_copies: bool = True) -> dict:
    """Model-state bytes per rank, from :func:`ds_asynchzp.formulas.sizing.model_state_bytes_per_rank`.

    Stock ZeRO-3 is the layout ``d_p = d_g = d_o = world`` (its partitions are the ``param_shard`` and
    ``grad_shard`` roles); hpZ adds a secondary partition over the node (``b·Ψ/G``, kept unquantized by
    DeepSpeed, also under qwZ). Quantized arms store the same states as their unquantized twins.
    ``grad_accum_bytes`` defaults to ``param_bytes`` (DeepSpeed accumulates in the model dtype by default).
    ``reference_models`` adds ``reference_params``: their partitions over the world, with hpZ's secondary over
    the node for hpz and zeropp and AsyncHZP's copy over ``d_p`` (`sizing.reference_bytes_per_rank`).
    """
    a = param_bytes if grad_accum_bytes is None else grad_accum_bytes
    if arm in ("zero3", "hpz", "zeropp"):
        parts = sizing.model_state_bytes_per_rank(num_params, world, world, world, world, param_bytes=param_bytes,
                                                  grad_accum_bytes=a)
        del parts["total"]
        if arm != "zero3":
            parts["param_secondary"] = sizing.model_state_bytes_per_rank(
                num_params, world, node_size, world, world, param_bytes=param_bytes)["param_shard"]
        if reference_models:
            parts["reference_params"] = sizing.stock_reference_bytes_per_rank(
                num_params, world, reference_models, param_bytes, None if arm == "zero3" else node_size)
        return {**parts, "total": sum(parts.values())}
    if arm.startswith("asynchzp"):
        d_o = world if d_o is None else d_o
        parts = sizing.model_state_bytes_per_rank(num_params, world, d_p, d_g, d_o, param_bytes=param_bytes,
                                                  grad_accum_bytes=a)
        if reference_models:
            parts["reference_params"] = sizing.reference_bytes_per_rank(num_params, world, d_p, reference_models,
                                                                        param_bytes, reference_copies)
            parts["total"] += parts["reference_params"]
        return parts
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")


def traffic_inputs(num_params: int, world: int, node_size: int, grad_accum: int, dtype: str,
                   multiple: int | None = None, grad_comm_bytes: float | None = None,
                   reference_models: int = 0, reference_copies: bool = True) -> traffic.TrafficInputs:
    """Inputs for a planned model: one tensor padded to a multiple of ``multiple`` (default: the world; ``d_o``
    for AsyncHZP), every element gathered, reduced and trained; gradients on the wire in the parameter dtype unless
    ``grad_comm_bytes`` says otherwise (fp32 under sequence parallelism)."""
    padded = sizing.padded_num_params([num_params], world if multiple is None else multiple)
    b = DTYPE_BYTES[dtype]
    return traffic.TrafficInputs(world=world, node_size=node_size, grad_accum=grad_accum, gathered_elements=padded,
                                 reduced_elements=padded, trainable_elements=padded, param_bytes=b,
                                 grad_comm_bytes=b if grad_comm_bytes is None else grad_comm_bytes,
                                 reference_models=reference_models, reference_copies=reference_copies)
