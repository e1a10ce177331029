"""Plan a cluster before training: the layout ``"auto"`` picks and why, and every arm's model-state memory, bytes
and communication time per optimizer step (`plan`).

The layout comes from :func:`ds_asynchzp.config.resolve_layout` itself (``"auto"`` included, with its reason), the
arms' figures from `planner.arm_formulas`; `planner.moe`, `planner.offload` and `planner.sequence_parallel` add
AutoEP's experts, optimizer offload and Ulysses sequence parallelism. Every arm's collectives are placed on the
links of the declared topology by `formulas.links` (NCCL's rings over nodes of ``node_size`` ranks with
``nics_per_node`` NICs each, default one per rank): bytes leaving the busiest NIC and bytes the busiest rank
sends over NVLink. Communication time = each collective at the pace of its busiest link, the collectives one
after another (no overlap between them or with compute, no latency): an upper bound.
"""

from __future__ import annotations

from ..config import AsyncHZPConfig, resolve_layout
from ..errors import AsyncHZPConfigError
from ..formulas import links, sizing
from ..layout import HierarchicalLayout
from . import moe as moe_plan
from . import offload as offload_plan
from . import sequence_parallel as sp_plan
from .arm_formulas import (ARM_DESCRIPTIONS, ARMS, DTYPE_BYTES, arm_bytes, arm_collectives, arm_memory,
                           arm_quantization, traffic_inputs)

#: Bandwidths "auto" assumes when the plan is given none: the defaults of the config keys
#: async_hzp.intra_node_bandwidth_gbps / inter_node_bandwidth_gbps.
DEFAULT_INTRA_BW = 800e9 / 8
DEFAULT_INTER_BW = 200e9 / 8


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
                        offload_optimizer: bool = False, sp: "sp_plan.SpInputs | None" = None,
                        nics_per_node: int | None = None, reference_models: int = 0) -> dict:
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
    if nics_per_node is not None:
        section["nics_per_node"] = nics_per_node
    if reference_models:
        section["reference_models"] = reference_models
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
    return {"d_p": layout.sizes.param_shard_size, "d_g": layout.sizes.grad_shard_size,
            "d_o": layout.sizes.optimizer_shard_size, "reason": layout.auto_reason, "error": None}


def plan(num_params: int, world: int, node_size: int, grad_accum: int = 1, dtype: str = "bf16",
         intra_bw: float | None = None, inter_bw: float | None = None, device_memory: int | None = None,
         memory_budget: float | None = None, param_shard_size: int | str | None = "auto",
         grad_shard_size: int | str | None = None, optimizer_shard_size: int | str | None = "auto",
         grad_accum_dtype: str | None = None, moe: "moe_plan.MoeInputs | None" = None,
         offload_optimizer: bool = False, sp: "sp_plan.SpInputs | None" = None,
         nics_per_node: int | None = None, allreduce: str = "ring", reference_models: int = 0) -> dict:
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

    ``nics_per_node`` (default: ``node_size``, one NIC per rank) and ``allreduce`` (``"ring"`` or ``"tree"``:
    NCCL's algorithm for all-reduces spanning nodes) declare the topology: per arm, ``links`` holds the bytes
    on the busiest NIC and the busiest rank's NVLink (`formulas.links.LinkLoad.summary`), and ``comm_time_s``
    the seconds on each at ``inter_bw`` per NIC and ``intra_bw`` per rank, and ``total``, each collective at its
    busiest link's pace, one after another (`formulas.links.step_seconds`).
    ``bytes_per_step`` keeps the bytes each rank sends (the ring model), split by whether the group spans nodes.

    ``reference_models`` (``async_hzp.reference_models``) plans that many models of the same size without an
    optimizer, each with one forward per micro-step: "auto" counts them, and every arm's memory and bytes include
    them (``reference_params``; the ``reference_gather`` flow).
    """
    topology = links.Topology(world, node_size, nics_per_node, "nccl", allreduce)
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
                  intra_bw=intra_bw, inter_bw=inter_bw, offload_optimizer=offload_optimizer, sp=sp,
                  nics_per_node=nics_per_node, reference_models=reference_models)
    # AsyncHZP gives reference models hpZ's copy except under SP and AutoEP (`config_compat.reference_copy_refusal`).
    copies = sp is None and moe is None
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
            fixed=fixed, offload_optimizer=offload_optimizer, reference_models=reference_models,
            reference_copies=copies)
        source = "smallest memory (auto found no fit)"

    arms = {}
    sp_bytes = None if sp is None else sp_plan.all_to_all_bytes(sp, world, node_size, grad_accum, b)
    for arm in ARMS:
        asynchzp = arm.startswith("asynchzp")
        t = traffic_inputs(num_params, world, node_size, grad_accum, dtype, multiple=d_o if asynchzp else world,
                           grad_comm_bytes=None if sp is None else sp.grad_comm_bytes,
                           reference_models=reference_models, reference_copies=copies)
        memory = arm_memory(arm, t.trainable_elements, world, node_size, d_p, d_g, b, d_o=d_o, grad_accum_bytes=a,
                            reference_models=reference_models, reference_copies=copies)
        moved = arm_bytes(arm, t, d_p, d_g, d_o)
        collectives = arm_collectives(arm, t, d_p, d_g, d_o)
        if sp is not None:
            moved = {w: moved[w] + sp_bytes[w] for w in ("intra_node", "inter_node")}
            collectives += sp_plan.all_to_all_collectives(sp, world, grad_accum, b)
        families = family_links = None
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
            family_collectives = {
                "dense": collectives,
                "expert": moe_plan.expert_collectives(
                    arm, moe, world, node_size, grad_accum, b, dense_layout,
                    lambda lay, arm=arm: arm_quantization(arm, lay.world, lay.node_size, lay.param_shard_size,
                                                          lay.grad_shard_size, lay.optimizer_shard_size)),
                "tokens": moe_plan.token_collectives(moe, world, grad_accum, b)}
            family_links = {f: links.link_load(c, topology).summary() for f, c in family_collectives.items()}
            collectives = [c for fam in family_collectives.values() for c in fam]
            moved = dict(moved, **{w: sum(f[w] for f in families.values()) for w in ("intra_node", "inter_node")})
            expert_states = moe_plan.expert_memory(arm, moe, world, node_size, dense_layout, b, a)
            memory = {k: memory.get(k, 0) + expert_states.get(k, 0) for k in set(memory) | set(expert_states)}
        if intra_bw and inter_bw:
            load, times = links.load_and_seconds(collectives, topology, inter_bw, intra_bw)
        else:
            load, times = links.link_load(collectives, topology), None
        arms[arm] = {
            "description": ARM_DESCRIPTIONS[arm],
            "model_state_bytes": memory,
            "fits_device_memory": None if device_memory is None else memory["total"] <= device_memory,
            "links": load.summary(),
            "bytes_per_step": moved,
            "comm_time_s": times,
        }
        if families is not None:
            arms[arm]["by_family"] = families
            arms[arm]["links_by_family"] = family_links
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
                   "inter_bw_bytes_per_s": inter_bw, "device_memory_bytes": device_memory,
                   "nics_per_node": topology.nics, "allreduce": allreduce, "topology": topology.describe(),
                   "reference_models": reference_models},
        "auto": auto,
        "layout": {"d_p": d_p, "d_g": d_g, "d_o": d_o, "source": source, "reason": chosen["reason"]},
        "arms": arms,
        "assumptions": [
            "bytes per optimizer step placed on physical links: NCCL rings (flat, node by node; every ring edge "
            "carries (k-1)/k of S, twice for an all-reduce), channels spread evenly over the NICs next to a group's "
            "members, so a node of a group spanning nodes sends one edge's bytes over its NICs and each member "
            "(m-1)/m of an edge over NVLink; all-to-alls: to another node out of the NIC on the receiver's rail "
            "(PXN); buffers large enough to use every channel; scalar all-reduces left out",
            "all-reduces spanning nodes: " + ("ring (NCCL's choice for large buffers on nodes of several NICs; its "
                                              "double binary tree moves the same mean bytes per node)"
                                              if allreduce == "ring" else
                                              "NCCL's double binary tree over the nodes (2S per inner node, S on 2 "
                                              "nodes)"),
            "comm s/step: each collective at the pace of its busiest link (NIC bytes / NIC bandwidth, or a rank's "
            "NVLink bytes / NVLink bandwidth), the collectives one after another: no overlap between them or with "
            "compute, no latency, so an upper bound; NIC s and NVLink s: the whole step's bytes on that link, a "
            "lower bound",
            "sent GB/rank (JSON bytes_per_step): what each rank sends, split by whether its group spans nodes",
            "zeropp: INT8 weight gathers, hpZ secondary per node, INT4 grads; cross-node grads 0.25x of bf16",
            "asynchzp-q: cross-node gradient exchange and parameter refresh in INT8 blocks of "
            f"{AsyncHZPConfig.model_fields['quantization_block_size'].default} values plus one fp32 scale each; "
            "intra-node traffic unquantized",
            "asynchzp arms: parameters padded to a multiple of d_o, the others' to a multiple of the world",
            "memory: model states only (no activations, buffers, fragmentation)",
        ],
    }
    if reference_models:
        result["assumptions"].append(
            f"{reference_models} reference model(s) of the same size without an optimizer, one forward per "
            "micro-step: partitioned over the world, plus hpZ's secondary over the node (hpz, zeropp) or AsyncHZP's "
            "copy over d_p (1 < d_p < world; not under sequence parallelism or AutoEP, where their engines stay "
            "stock's); their gathers counted from the second step on")
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
