"""Plan a cluster before training: model-state memory, bytes and communication time per optimizer step per arm.

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

The inputs as people write them (``70B``, ``400GB/s``, ``80GB``, a model spec) are read by `planner.inputs`.
"""

from __future__ import annotations

from dataclasses import replace

from ..formulas import sizing, traffic
from ..config import AsyncHZPConfig, resolve_layout
from ..errors import AsyncHZPConfigError
from ..layout import HierarchicalLayout
from ..quantization import NO_QUANTIZATION, QuantizationPlan, plan_quantization
from . import moe as moe_plan
from . import offload as offload_plan
from . import sequence_parallel as sp_plan
from . import volume
# Part of the package's interface: the CLI and callers read their inputs as planner.parse_count and so on.
from .inputs import parse_bandwidth, parse_count, parse_memory, params_from_model_spec  # noqa: F401

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

# ------------------------------------------------------------------------------------------ the arms
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


def arm_memory(arm: str, num_params: int, world: int, node_size: int, d_p: int, d_g: int, param_bytes: int,
               d_o: int | None = None, grad_accum_bytes: int | None = None) -> dict:
    """Model-state bytes per rank, from :func:`ds_asynchzp.formulas.sizing.model_state_bytes_per_rank`.

    Stock ZeRO-3 is the layout ``d_p = d_g = d_o = world`` (its partitions are the ``param_shard`` and
    ``grad_shard`` roles); hpZ adds a secondary partition over the node (``b·Ψ/G``, kept unquantized by
    DeepSpeed, also under qwZ). Quantized arms store the same states as their unquantized twins.
    ``grad_accum_bytes`` defaults to ``param_bytes`` (DeepSpeed accumulates in the model dtype by default).
    """
    a = param_bytes if grad_accum_bytes is None else grad_accum_bytes
    if arm in ("zero3", "hpz", "zeropp"):
        parts = sizing.model_state_bytes_per_rank(num_params, world, world, world, world, param_bytes=param_bytes,
                                                  grad_accum_bytes=a)
        if arm != "zero3":
            parts["param_secondary"] = sizing.model_state_bytes_per_rank(
                num_params, world, node_size, world, world, param_bytes=param_bytes)["param_shard"]
            parts["total"] = sum(v for k, v in parts.items() if k != "total")
        return parts
    if arm.startswith("asynchzp"):
        return sizing.model_state_bytes_per_rank(num_params, world, d_p, d_g, world if d_o is None else d_o,
                                                 param_bytes=param_bytes, grad_accum_bytes=a)
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")


# ------------------------------------------------------------------------------------------- planning
#: Bandwidths "auto" assumes when the plan is given none: the defaults of the config keys
#: async_hzp.intra_node_bandwidth_gbps / inter_node_bandwidth_gbps.
DEFAULT_INTRA_BW = 800e9 / 8
DEFAULT_INTER_BW = 200e9 / 8


def traffic_inputs(num_params: int, world: int, node_size: int, grad_accum: int, dtype: str,
                   multiple: int | None = None, grad_comm_bytes: float | None = None) -> traffic.TrafficInputs:
    """Inputs for a planned model: one tensor padded to a multiple of ``multiple`` (default: the world; ``d_o``
    for AsyncHZP), every element gathered, reduced and trained; gradients on the wire in the parameter dtype unless
    ``grad_comm_bytes`` says otherwise (fp32 under sequence parallelism)."""
    padded = sizing.padded_num_params([num_params], world if multiple is None else multiple)
    b = DTYPE_BYTES[dtype]
    return traffic.TrafficInputs(world=world, node_size=node_size, grad_accum=grad_accum, gathered_elements=padded,
                                 reduced_elements=padded, trainable_elements=padded, param_bytes=b,
                                 grad_comm_bytes=b if grad_comm_bytes is None else grad_comm_bytes)


def _ds_config(world: int, grad_accum: int, dtype: str, grad_accum_dtype: str | None, section: dict,
               offload_optimizer: bool = False, sp_grad_comm_bytes: int = 4) -> dict:
    """The ds_config the engine would get for this plan (what resolve_layout reads for "auto")."""
    config = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": grad_accum, "async_hzp": section}
    if offload_optimizer:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if dtype in ("bf16", "fp16"):
        config[dtype] = {"enabled": True}
    if grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    if sp_grad_comm_bytes != 4:   # only the element size matters here: bf16 stands for any 2-byte dtype
        config["seq_parallel_communication_data_type"] = "bf16"
    return config


def resolve_plan_layout(num_params: int, world: int, node_size: int, sizes: dict, *, grad_accum: int = 1,
                        dtype: str = "bf16", grad_accum_dtype: str | None = None, budget_bytes: float | None = None,
                        intra_bw: float | None = None, inter_bw: float | None = None,
                        offload_optimizer: bool = False, sp: "sp_plan.SpInputs | None" = None) -> dict:
    """The layout the engine resolves for ``sizes`` (``{"param_shard_size": "auto" | int | None, ...}``), through
    :func:`ds_asynchzp.config.resolve_layout` itself: ``{"d_p", "d_g", "d_o", "reason", "error"}``; with
    ``offload_optimizer`` for a ds_config that offloads the optimizer to the host.

    ``error`` is set (and the sizes None) when "auto" finds nothing within the budget; an invalid integer size
    raises the engine's AsyncHZPConfigError."""
    section = {"node_size": node_size, **{k: v for k, v in sizes.items() if v is not None}}
    if budget_bytes is not None:
        section["memory_budget_gb"] = budget_bytes / sizing.BYTES_PER_GB
    section["intra_node_bandwidth_gbps"] = (intra_bw or DEFAULT_INTRA_BW) * 8 / 1e9
    section["inter_node_bandwidth_gbps"] = (inter_bw or DEFAULT_INTER_BW) * 8 / 1e9
    config = _ds_config(world, grad_accum, dtype, grad_accum_dtype, section, offload_optimizer,
                        4 if sp is None else sp.grad_comm_bytes)
    padded = sizing.padded_num_params([num_params], world)  # as the engine counts before d_o is known
    try:
        layout = resolve_layout(config, world, node_size, has_client_optimizer=True, num_parameters=padded,
                                sequence_parallel_size=1 if sp is None else sp.sp)
    except AsyncHZPConfigError as exc:
        if "async_hzp.memory_budget_gb" not in exc.keys:
            raise
        return {"d_p": None, "d_g": None, "d_o": None, "reason": None, "error": str(exc)}
    return {"d_p": layout.param_shard_size, "d_g": layout.grad_shard_size, "d_o": layout.optimizer_shard_size,
            "reason": layout.auto_reason, "error": None}


def check_layout(world: int, node_size: int, d_p: int, d_g: int, d_o: int | None = None) -> None:
    """Raise the engine's own AsyncHZPConfigError when explicit sizes are not a valid layout."""
    section = {"node_size": node_size, "param_shard_size": d_p, "grad_shard_size": d_g}
    if d_o is not None:
        section["optimizer_shard_size"] = d_o
    resolve_layout({"zero_optimization": {"stage": 3}, "async_hzp": section}, world, node_size,
                   has_client_optimizer=True)


def plan(num_params: int, world: int, node_size: int, grad_accum: int = 1, dtype: str = "bf16",
         intra_bw: float | None = None, inter_bw: float | None = None, device_memory: int | None = None,
         memory_budget: float | None = None, param_shard_size: int | str | None = "auto",
         grad_shard_size: int | str | None = None, optimizer_shard_size: int | str | None = "auto",
         grad_accum_dtype: str | None = None, moe: "moe_plan.MoeInputs | None" = None,
         offload_optimizer: bool = False, sp: "sp_plan.SpInputs | None" = None) -> dict:
    """The whole plan as a JSON-ready dict: inputs, the ``"auto"`` pick and why, and per arm memory, bytes, time.

    Budget for ``"auto"``: ``memory_budget`` if given, else ``sizing.DEFAULT_BUDGET_FRACTION`` of
    ``device_memory`` (what the engine's default gives on such a device), else ``sizing.default_budget_bytes``
    of this machine. The sizes follow the config's rules (``grad_shard_size=None`` follows
    ``param_shard_size``; ``optimizer_shard_size=None`` is the world); ``auto`` is what all three ``"auto"``
    would choose, ``layout`` what the given sizes resolve to (they are the same by default). If "auto" finds
    nothing within the budget, the arms are planned with the smallest-memory layout, which the memory columns
    then flag. ``grad_accum_dtype`` (default: ``dtype``) is ``data_types.grad_accum_dtype``.

    With ``moe`` (AutoEP's routed experts, `planner.moe`), ``d_o`` is the world (the only one AutoEP allows), the
    layout is chosen for the dense parameters within the budget (the experts' states come on top of it: the
    memory columns include them, the "auto" pick does not weigh them) and the arms' dense figures are theirs; every arm adds its experts' memory and bytes and the token all-to-all, split under
    ``by_family``; arms DeepSpeed cannot run with AutoEP are marked ``unavailable``.

    ``offload_optimizer`` (not with ``moe``) resolves the layouts for optimizer states on the host and adds
    ``auto_without_offload``, ``inputs["offload_optimizer"]``, ``inputs["host_device_bw_bytes_per_s"]`` and per arm
    an ``offload_optimizer`` entry (:func:`planner.offload.arm_entry`); the other keys keep their no-offload meaning.

    With ``sp`` (Ulysses sequence parallelism, `planner.sequence_parallel`), every arm's gradient flows travel in
    ``sp.grad_comm_bytes`` values and its bytes include the SP all-to-alls (also apart, as ``sp_all_to_all``);
    ``"auto"`` resolves as the engine does under SP.
    """
    if sp is not None:
        if moe is not None:
            raise ValueError("sequence parallelism is not planned together with AutoEP experts (DeepSpeed 0.19.8 "
                             "refuses AutoEP with SP)")
        sp_plan.check(sp, world)
    if moe is not None and offload_optimizer:
        raise ValueError("optimizer offload is not planned together with AutoEP experts")
    if moe is not None:
        moe_plan.check(moe, num_params, world, node_size)
        num_params -= moe.expert_params
    if world < 1 or node_size < 1 or world % node_size:
        raise ValueError(f"node size {node_size} must be >= 1 and divide the world size {world}")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    for name, value in (("dtype", dtype), ("grad_accum_dtype", grad_accum_dtype or dtype)):
        if value not in DTYPE_BYTES:
            raise ValueError(f"{name} must be one of {sorted(DTYPE_BYTES)}, got {value!r}")
    b, a = DTYPE_BYTES[dtype], DTYPE_BYTES[grad_accum_dtype or dtype]

    if memory_budget is not None:
        budget, budget_source = float(memory_budget), "given"
    elif device_memory is not None:
        budget = device_memory * sizing.DEFAULT_BUDGET_FRACTION
        budget_source = f"{sizing.DEFAULT_BUDGET_FRACTION:.0%} of device memory"
    else:
        budget, budget_source = float(sizing.default_budget_bytes(node_size)), "detected on this machine"
    common = dict(grad_accum=grad_accum, dtype=dtype, grad_accum_dtype=grad_accum_dtype, budget_bytes=budget,
                  intra_bw=intra_bw, inter_bw=inter_bw, offload_optimizer=offload_optimizer, sp=sp)
    auto_sizes = dict.fromkeys(sizing.SIZE_KEYS, "auto")
    sizes = dict(zip(sizing.SIZE_KEYS, (param_shard_size, grad_shard_size, optimizer_shard_size)))
    if moe is not None:  # AutoEP allows d_o = world only (config_compat.expert_issues); "auto" picks it
        auto_sizes["optimizer_shard_size"] = world
        if sizes["optimizer_shard_size"] in ("auto", None):
            sizes["optimizer_shard_size"] = world
        elif sizes["optimizer_shard_size"] != world:
            raise ValueError(f"optimizer shard size {sizes['optimizer_shard_size']}: with AutoEP experts it must be "
                             f"the world size {world}")
    auto = resolve_plan_layout(num_params, world, node_size, auto_sizes, **common)
    auto.update(budget_bytes=budget, budget_source=budget_source)
    without_offload = (resolve_plan_layout(num_params, world, node_size, auto_sizes,
                                           **dict(common, offload_optimizer=False)) if offload_optimizer else None)

    chosen = resolve_plan_layout(num_params, world, node_size, sizes, **common)
    given = ", ".join(f"{k}={v}" for k, v in sizes.items() if isinstance(v, int))
    if chosen["error"] is None:
        d_p, d_g, d_o = chosen["d_p"], chosen["d_g"], chosen["d_o"]
        source = ("given" if "auto" not in sizes.values() else "auto" + (f" with {given}" if given else ""))
    else:
        fixed = {k: v for k, v in sizes.items() if isinstance(v, int)}
        d_p, d_g, d_o, _ = sizing.smallest_memory_layout(
            sizing.padded_num_params([num_params], world), world, node_size, param_bytes=b, grad_accum_bytes=a,
            fixed=fixed, offload_optimizer=offload_optimizer)
        source = "smallest memory (auto found no fit)"

    arms = {}
    sp_bytes = None if sp is None else sp_plan.all_to_all_bytes(sp, world, node_size, grad_accum, b)
    for arm in ARMS:
        asynchzp = arm.startswith("asynchzp")
        t = traffic_inputs(num_params, world, node_size, grad_accum, dtype, multiple=d_o if asynchzp else world,
                           grad_comm_bytes=None if sp is None else sp.grad_comm_bytes)
        memory = arm_memory(arm, t.trainable_elements, world, node_size, d_p, d_g, b, d_o=d_o, grad_accum_bytes=a)
        moved = arm_bytes(arm, t, d_p, d_g, d_o)
        if sp is not None:
            moved = {w: moved[w] + sp_bytes[w] for w in ("intra_node", "inter_node")}
        families = None
        if moe is not None:
            if arm in moe_plan.UNSUPPORTED_ARMS:
                arms[arm] = {"description": ARM_DESCRIPTIONS[arm], "unavailable": moe_plan.UNSUPPORTED_ARMS[arm]}
                continue
            dense_layout = HierarchicalLayout(world, node_size, d_p, d_g, d_o)
            expert = moe_plan.expert_bytes(arm, moe, world, node_size, grad_accum, b, dense_layout,
                                           lambda lay, arm=arm: arm_quantization(
                                               arm, lay.world, lay.node_size, lay.param_shard_size,
                                               lay.grad_shard_size, lay.optimizer_shard_size))
            families = moe_plan.by_family(moved, expert, moe_plan.token_bytes(moe, world, node_size, grad_accum, b))
            moved = dict(moved, **{w: sum(f[w] for f in families.values()) for w in ("intra_node", "inter_node")})
            expert_states = moe_plan.expert_memory(arm, moe, world, node_size, dense_layout, b, a)
            memory = {k: memory.get(k, 0) + expert_states.get(k, 0) for k in set(memory) | set(expert_states)}
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
        if families is not None:
            arms[arm]["by_family"] = families
        if sp is not None:
            arms[arm]["sp_all_to_all"] = sp_bytes
        if offload_optimizer:
            arms[arm]["offload_optimizer"] = offload_plan.arm_entry(arm, t, d_p, d_g, d_o, a, device_memory,
                                                                   None if times is None else times["total"])
    padded = sizing.padded_num_params([num_params], world)
    result = {
        "moe": None if moe is None else {"expert_params": moe.expert_params, "ep_size": moe.ep_size,
                                         "tokens": moe.tokens, "hidden": moe.hidden, "top_k": moe.top_k,
                                         "expert_group": dict(zip(("members", "per_node"),
                                                                  moe_plan.expert_world(moe, world, node_size)))},
        "inputs": {"params": num_params, "padded_params": padded, "world": world, "node_size": node_size,
                   "nodes": world // node_size, "grad_accum": grad_accum, "dtype": dtype, "param_bytes": b,
                   "grad_comm_bytes": b, "grad_accum_bytes": a, "intra_bw_bytes_per_s": intra_bw,
                   "inter_bw_bytes_per_s": inter_bw, "device_memory_bytes": device_memory},
        "auto": auto,
        "layout": {"d_p": d_p, "d_g": d_g, "d_o": d_o, "source": source, "reason": chosen["reason"]},
        "arms": arms,
        "assumptions": [
            "ring model bytes sent per rank per optimizer step; scalar all-reduces left out",
            "comm time = intra/intra_bw + inter/inter_bw, bandwidths per rank, no overlap with compute",
            "zeropp: INT8 weight gathers, hpZ secondary per node, INT4 grads; cross-node grads 0.25x of bf16",
            "asynchzp-q: cross-node gradient exchange and parameter refresh in INT8 blocks of "
            f"{AsyncHZPConfig.model_fields['quantization_block_size'].default} values plus one fp32 scale each; "
            "intra-node traffic unquantized",
            "asynchzp arms: parameters padded to a multiple of d_o, the others' to a multiple of the world",
            "memory: model states only (no activations, buffers, fragmentation)",
        ],
    }
    if sp is not None:
        result["sequence_parallel"] = {"sp": sp.sp, "seq_len": sp.seq_len, "hidden": sp.hidden, "layers": sp.layers,
                                       "kv_hidden": sp.kv_hidden or sp.hidden,
                                       "inter_node_share": sp_plan.inter_node_share(sp.sp, world, node_size),
                                       "all_to_all_bytes_per_step": sp_bytes,
                                       "description": sp_plan.describe(sp, world, node_size)}
        result["inputs"]["grad_comm_bytes"] = sp.grad_comm_bytes
        result["assumptions"] += sp_plan.ASSUMPTIONS
    if offload_optimizer:
        result["inputs"].update(offload_optimizer=True, host_device_bw_bytes_per_s=sizing.HOST_DEVICE_BW_BYTES_S)
        result["auto_without_offload"] = without_offload
        result["assumptions"] += offload_plan.ASSUMPTIONS
    return result


# ------------------------------------------------------------------- checking a benchmark run (--check)
CHECKED_ARMS = ("zero3", "hpz", "zeropp", "asynchzp")  # and every arm named asynchzp..., and their -offload twins
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

    rows, notes, layouts, used, link_predictions = [], [], {}, None, {}
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
        # Node links carry only the ring edges between nodes (traffic.link_bytes), not the whole inter-node
        # ring-model figure: predicted once, compared with the ledger's own estimate and with the link counters.
        link = traffic.link_bytes(arm, t, d_p, d_g, d_o, quantization)
        link_predictions[arm] = link
        if entry.get("link_bytes_inter_node_per_step") is not None:
            rows.append(_compare(arm, "inter_node_link", link, float(entry["link_bytes_inter_node_per_step"])))
        wire = entry.get("wire_bytes_inter_node_per_step")
        if wire is not None:
            rows.append(_compare(arm, "inter_node_wire", link, float(wire) / _overhead_of(config)))
    if not rows:
        notes.append("no arm of results.json could be checked")
    elements = world_elements or used or {"gathered": 0, "reduced": 0, "trainable": 0}
    return {"ok": bool(rows) and all(r["ok"] for r in rows), "rows": rows, "notes": notes,
            "elements": {k: elements[k] for k in ("gathered", "reduced", "trainable")},
            "inputs": {"world": world, "node_size": node_size, "grad_accum": int(config["grad_accum"]),
                       "dtype": dtype},
            "asynchzp_layouts": layouts, "wire_overhead_factor": _overhead_of(config),
            "link_bytes_per_rank": link_predictions}
