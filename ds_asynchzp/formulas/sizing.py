"""Analytic per-rank memory model for AsyncHZP and the ``"auto"`` layout rule.

AsyncHZP keeps three group sizes ``d_p | d_g | d_o | world``. DeepSpeed partitions every parameter over an
optimizer group of ``d_o`` consecutive ranks: padded to a multiple of ``d_o``, each parameter is cut into
``d_o`` atoms. Rank ``r`` then holds

* a parameter shard of ``d_o/d_p`` atoms of every parameter (frozen ones included): ``b·Ψ/d_p`` bytes;
* a gradient-accumulation shard of ``d_o/d_g`` atoms of every trainable parameter, in the gradient
  accumulation dtype (``data_types.grad_accum_dtype``, by default the model dtype): ``a·Ψ_t/d_g``;
* the fp32 master copy and the Adam moments of one atom: ``(4 + 8)·Ψ_t/d_o``.

DeepSpeed's own parameter partition and gradient partition are views into the two shards (their own row), so
nothing else is counted: there is no separate primary partition and no separate fp32 gradient partition.
Stock ZeRO-3 is the special case ``d_p = d_g = d_o = world``.

All byte counts are for *model states only*: activations, communication buckets, temporary gather buffers and
allocator fragmentation are not modelled, which is why the default budget below is only half of the memory.

``num_params`` (Ψ) must already be padded by the caller: every parameter is rounded up to a multiple of
``d_o`` (see :func:`padded_num_params`). A count padded to a multiple of the world is also padded to every
``d_o`` that divides it, and exceeds the ``d_o``-padded count by less than ``world`` elements per parameter,
so it is a safe (slightly pessimistic) input when ``d_o`` is not known yet, as for ``"auto"``.

The ``"auto"`` rule (:func:`choose_layout`) keeps the layouts whose model states fit the budget and takes the
one with the least estimated communication time per optimizer step, using the traffic formulas of
:mod:`ds_asynchzp.formulas.traffic`; the reason string it returns names the numbers behind the choice.

**Optimizer offload** (``zero_optimization.offload_optimizer.device: "cpu"``, :func:`placement_bytes_per_rank`,
:func:`stock_placement_bytes_per_rank`). The host-side optimizer (DeepSpeedCPUAdam) reads fp32 gradients, so the
host holds them besides the fp32 master and the moments:

* AsyncHZP: device ``b·Ψ/d_p + a·Ψ_t/d_g`` (the gradient shard stays on the device, where its reductions run);
  host ``(12 + 4)·Ψ_t/d_o``. With ``d_o < N`` every one of the ``N/d_o`` optimizer replicas keeps and steps its
  own host copy, so a node's host holds ``G·16·Ψ_t/d_o``.
* Stock ZeRO-3: device ``b·Ψ/N`` only; its gradient partition (``grad_partitions_flat_buffer``, ``a·Ψ_t/N``)
  lives pinned on the host, next to ``(12 + 4)·Ψ_t/N``. ZeRO++ hpZ adds its secondary partition ``b·Ψ/G`` on
  the device.

**Reference models** (``async_hzp.reference_models``: R models without an optimizer, each the trained model's
size, e.g. DPO's reference) add ``reference_params`` on the device: ``R·b·Ψ(1/N + 1/d_p)`` under AsyncHZP, whose
reference engines keep their partition over the world and get hpZ's copy over ``d_p`` (`runtime/api.py`; ``R·b·Ψ/N``
where ``d_p`` is 1 or the world and the engine is stock's), ``R·b·Ψ/N`` under stock ZeRO-3 (plus ``R·b·Ψ/G`` with
hpZ). Their forwards add the ``reference_gather`` flow of :mod:`ds_asynchzp.formulas.traffic` to the time.

With offload the budget of ``"auto"`` bounds the *device* bytes; host bytes are reported, and the host↔device
copies (the ``host_device`` flow of :mod:`ds_asynchzp.formulas.traffic`) join the estimated time at
:data:`HOST_DEVICE_BW_BYTES_S`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable

from . import links, step_collectives, traffic

logger = logging.getLogger(__name__)

#: Bytes per "GB" in ``async_hzp.memory_budget_gb``: binary gigabytes (GiB),
#: matching how accelerator memory is reported by drivers and torch.
BYTES_PER_GB = 1 << 30

#: Fraction of the detected memory used as the default budget for model
#: states; the rest is left for activations, gather/communication buffers and
#: fragmentation, which the analytic model does not see.
DEFAULT_BUDGET_FRACTION = 0.5

#: Names of the three sizes, as JSON keys of the ``async_hzp`` section, in (d_p, d_g, d_o) order.
SIZE_KEYS = ("param_shard_size", "grad_shard_size", "optimizer_shard_size")

#: Host↔device copy rate per rank that ``"auto"`` and ``asynchzp-plan`` assume under optimizer offload: what
#: pinned copies reach on PCIe 4.0 x16. The copies to the host come before the optimizer step and those back
#: after it, so the two directions do not overlap and one rate covers both.
HOST_DEVICE_BW_BYTES_S = 25e9


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in ascending order."""
    if n < 1:
        raise ValueError(f"divisors() needs a positive integer, got {n}")
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if d * d != n]
    return small + large


def padded_num_params(numels: Iterable[int], multiple: int) -> int:
    """Parameter count after DeepSpeed's padding: each tensor rounded up to a multiple of ``multiple`` (``d_o``)."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return sum(-(-int(n) // multiple) * multiple for n in numels)


def _ceil_div(a: int, b: int) -> int:
    # Exact for padded inputs; rounding up keeps estimates conservative otherwise.
    return -(-a // b)


def model_state_bytes_per_rank(
    num_params: int,
    world: int,
    d_p: int,
    d_g: int,
    d_o: int,
    param_bytes: int = 2,
    grad_accum_bytes: int = 2,
    master_bytes: int = 4,
    optim_state_bytes: int = 8,
    num_trainable: int | None = None,
) -> dict[str, int]:
    """Bytes of model states one rank holds for a layout ``(d_p, d_g, d_o)``.

    ``num_params`` is the padded parameter count Ψ (frozen parameters included), ``num_trainable`` the padded
    trainable count Ψ_t (default: Ψ, every parameter trained). Defaults describe bf16/fp16 parameters and
    gradient accumulation in the model dtype (DeepSpeed's default), fp32 master weights and Adam (two fp32
    moments = 8 bytes per parameter).

    Returns a dict with keys:

    * ``param_shard``: ``param_bytes·Ψ/d_p``, the parameter shard (DeepSpeed's partition is its own row);
    * ``grad_shard``: ``grad_accum_bytes·Ψ_t/d_g``, the accumulation shard (DeepSpeed's gradient partition
      is its own row);
    * ``master``: ``master_bytes·Ψ_t/d_o``;
    * ``optimizer_state``: ``optim_state_bytes·Ψ_t/d_o``;
    * ``total``: the sum of the above.
    """
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    trainable = num_params if num_trainable is None else num_trainable
    if not 0 <= trainable <= num_params:
        raise ValueError(f"num_trainable must be between 0 and num_params ({num_params}), got {num_trainable}")
    for name, d in (("world", world), ("d_p", d_p), ("d_g", d_g), ("d_o", d_o)):
        if d < 1:
            raise ValueError(f"{name} must be >= 1, got {d}")
    psi, psi_t = int(num_params), int(trainable)
    parts = {
        "param_shard": _ceil_div(param_bytes * psi, d_p),
        "grad_shard": _ceil_div(grad_accum_bytes * psi_t, d_g),
        "master": _ceil_div(master_bytes * psi_t, d_o),
        "optimizer_state": _ceil_div(optim_state_bytes * psi_t, d_o),
    }
    parts["total"] = sum(parts.values())
    return parts


def _with_total(parts: dict[str, int]) -> dict[str, int]:
    return {**parts, "total": sum(parts.values())}


def reference_bytes_per_rank(num_params: int, world: int, d_p: int, reference_models: int,
                             param_bytes: int = 2, copies: bool = True) -> int:
    """Device bytes per rank of ``reference_models`` models of ``num_params`` elements without an optimizer under
    AsyncHZP: ``R·b·Ψ(1/N + 1/d_r)`` with their copy over ``d_r = d_p`` (1 < d_p < N, and ``copies``: the config
    allows it, `config_compat.reference_copy_refusal`), else ``R·b·Ψ/N`` (stock's engine)."""
    if reference_models < 0:
        raise ValueError(f"reference_models must be >= 0, got {reference_models}")
    per_model = _ceil_div(param_bytes * int(num_params), world)
    d_r = traffic.reference_group_size(world, d_p, copies)
    if d_r < world:
        per_model += _ceil_div(param_bytes * int(num_params), d_r)
    return reference_models * per_model


def stock_reference_bytes_per_rank(num_params: int, world: int, reference_models: int, param_bytes: int = 2,
                                   secondary_size: int | None = None) -> int:
    """The same under stock ZeRO-3: ``R·b·Ψ/N``, plus hpZ's secondary ``R·b·Ψ/G`` with ``secondary_size`` G > 1
    (DeepSpeed builds it for every model zero.Init converts, also where G is the world)."""
    per_model = _ceil_div(param_bytes * int(num_params), world)
    if secondary_size is not None and secondary_size > 1:
        per_model += _ceil_div(param_bytes * int(num_params), secondary_size)
    return reference_models * per_model


def placement_bytes_per_rank(num_params: int, world: int, d_p: int, d_g: int, d_o: int, *, offload_optimizer: bool,
                             reference_models: int = 0, reference_copies: bool = True,
                             **sizes) -> dict[str, dict[str, int]]:
    """Where an AsyncHZP rank's model states live: ``{"device": parts, "host": parts}``, each with a ``total``.

    Without offload everything is on the device (:func:`model_state_bytes_per_rank`; the host part is empty).
    With ``offload_optimizer`` the device keeps ``param_shard`` and ``grad_shard`` (the gradient reductions run
    there) and the host holds ``master``, ``optimizer_state`` and ``fp32_grad`` (``4·Ψ_t/d_o``: the ``.grad``
    of DeepSpeed's fp32 flat partitions, the own atom's gradients that the host optimizer reads). ``sizes``: the
    element sizes and ``num_trainable`` of :func:`model_state_bytes_per_rank`. ``reference_models`` adds
    ``reference_params`` on the device (:func:`reference_bytes_per_rank`)."""
    parts = model_state_bytes_per_rank(num_params, world, d_p, d_g, d_o, **sizes)
    del parts["total"]
    if reference_models:
        parts["reference_params"] = reference_bytes_per_rank(num_params, world, d_p, reference_models,
                                                              sizes.get("param_bytes", 2), reference_copies)
    if not offload_optimizer:
        return {"device": _with_total(parts), "host": _with_total({})}
    trainable = num_params if sizes.get("num_trainable") is None else sizes["num_trainable"]
    host = {k: parts.pop(k) for k in ("master", "optimizer_state")}
    host["fp32_grad"] = _ceil_div(traffic.HOST_GRAD_BYTES * int(trainable), d_o)
    return {"device": _with_total(parts), "host": _with_total(host)}


def stock_placement_bytes_per_rank(num_params: int, world: int, *, offload_optimizer: bool,
                                   secondary_size: int | None = None, reference_models: int = 0,
                                   **sizes) -> dict[str, dict[str, int]]:
    """Where a rank of stock ZeRO-3 keeps its model states, ``{"device": parts, "host": parts}``.

    Stock ZeRO-3 is the layout ``d_p = d_g = d_o = world``; ``secondary_size`` (ZeRO++ hpZ's
    ``zero_hpz_partition_size``, the node) adds ``param_secondary``, ``b·Ψ/secondary_size``, on the device
    (DeepSpeed keeps it unquantized, also under qwZ). With ``offload_optimizer`` only the parameter partitions
    stay on the device: DeepSpeed 0.19.8 allocates the gradient partition buffer pinned on the host
    (``grad_shard``), beside ``master``, ``optimizer_state`` and ``fp32_grad``. ``sizes`` as for
    :func:`placement_bytes_per_rank`."""
    placed = placement_bytes_per_rank(num_params, world, world, world, world, offload_optimizer=offload_optimizer,
                                      **sizes)
    device = {k: v for k, v in placed["device"].items() if k != "total"}
    host = {k: v for k, v in placed["host"].items() if k != "total"}
    if offload_optimizer:
        host = {"grad_shard": device.pop("grad_shard"), **host}
    if secondary_size is not None:
        if secondary_size < 1:
            raise ValueError(f"secondary_size must be >= 1, got {secondary_size}")
        device["param_secondary"] = _ceil_div(sizes.get("param_bytes", 2) * int(num_params), secondary_size)
    if reference_models:
        device["reference_params"] = stock_reference_bytes_per_rank(num_params, world, reference_models,
                                                                    sizes.get("param_bytes", 2), secondary_size)
    return {"device": _with_total(device), "host": _with_total(host)}


def default_budget_bytes(node_size: int) -> int:
    """Default per-rank budget for model states when ``memory_budget_gb`` is unset.

    * With CUDA available: ``DEFAULT_BUDGET_FRACTION`` of device 0's total
      memory (each rank owns one device, so no further split is needed).
    * Otherwise (CPU training): the same fraction of this rank's share of host
      memory, i.e. physical memory divided by ``node_size`` ranks on the host.

    Raises AsyncHZPConfigError naming ``async_hzp.memory_budget_gb`` when the
    memory size cannot be detected.
    """
    try:
        import torch

        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(0).total_memory
            return int(total * DEFAULT_BUDGET_FRACTION)
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        host = 0
    if host <= 0:
        from ..errors import AsyncHZPConfigError

        raise AsyncHZPConfigError(
            "async_hzp.memory_budget_gb",
            "is unset and the memory size of this machine could not be detected.",
            "set async_hzp.memory_budget_gb to the per-rank memory (GiB) available for model states.",
        )
    return int(host / max(node_size, 1) * DEFAULT_BUDGET_FRACTION)


# ------------------------------------------------------------------------------------------ layouts
def valid_grad_sizes(d_p: int, node_size: int, world: int) -> list[int]:
    """``d_g`` values allowed with ``d_p``: multiples of ``d_p`` dividing the world that either divide the node
    or are whole multiples of it (a gradient shard group spans nodes only in whole nodes)."""
    return [v for v in divisors(world) if v % d_p == 0 and (node_size % v == 0 or v % node_size == 0)]


def valid_layouts(world: int, node_size: int) -> list[tuple[int, int, int]]:
    """Every ``(d_p, d_g, d_o)`` the engine accepts: ``d_p | node``, ``d_p | d_g``, ``d_g | d_o | world``,
    ``d_g`` divides the node or is a multiple of it, and ``d_o > 1`` unless the world is one rank (the config
    refuses an unsharded optimizer, `config._layout_issues`). Ascending order."""
    if world < 1 or node_size < 1 or world % node_size != 0:
        raise ValueError(f"node_size ({node_size}) must be >= 1 and divide world ({world})")
    return [(d_p, d_g, d_o)
            for d_p in divisors(node_size)
            for d_g in valid_grad_sizes(d_p, node_size, world)
            for d_o in divisors(world) if d_o % d_g == 0 and (d_o > 1 or world == 1)]


def comm_seconds_per_step(num_params: int, world: int, node_size: int, d_p: int, d_g: int, d_o: int, *,
                          param_bytes: int, grad_comm_bytes: int, grad_accum_steps: int,
                          intra_bw_bytes_s: float, inter_bw_bytes_s: float, offload_optimizer: bool = False,
                          host_device_bw_bytes_s: float = HOST_DEVICE_BW_BYTES_S,
                          nics_per_node: int | None = None, reference_models: int = 0,
                          reference_copies: bool = True) -> tuple[float, dict]:
    """Estimated communication seconds per optimizer step of one layout, and the bytes behind it: every element
    gathered, reduced and trained (P_g = P_r = P_t = Ψ), on NCCL's rings over nodes of ``node_size`` ranks with
    ``nics_per_node`` NICs each (default one per rank), from `formulas.links`: each collective takes the time of
    its busiest link (NICs at ``inter_bw_bytes_s`` each, a rank's fabric at ``intra_bw_bytes_s``), one after
    another, no overlap with compute (`links.step_seconds`). The bytes are ``{"nic_busiest", "fabric_busiest",
    "nic_s", "fabric_s"}``: the step's bytes on the busiest NIC and the busiest rank's fabric, and their seconds.

    With ``offload_optimizer`` the bytes add ``host_device`` (:func:`traffic.asynchzp_host_device_bytes`, both
    directions) and the seconds its copy time at ``host_device_bw_bytes_s``; the network flows are the same.
    ``reference_models`` adds their forwards' gathers (``reference_gather``)."""
    t = traffic.TrafficInputs(world=world, node_size=node_size, grad_accum=grad_accum_steps,
                              gathered_elements=num_params, reduced_elements=num_params,
                              trainable_elements=num_params, param_bytes=param_bytes, grad_comm_bytes=grad_comm_bytes,
                              reference_models=reference_models, reference_copies=reference_copies)
    collectives = step_collectives.asynchzp(t, d_p, d_g, d_o)
    topology = links.Topology(world, node_size, nics_per_node)
    load, times = links.load_and_seconds(collectives, topology, inter_bw_bytes_s, intra_bw_bytes_s)
    moved = {"nic_busiest": load.busiest_nic, "fabric_busiest": load.busiest_fabric, "nic_s": times["nic"],
             "fabric_s": times["fabric"]}
    seconds = times["total"]
    if offload_optimizer:
        if host_device_bw_bytes_s <= 0:
            raise ValueError("host_device_bw_bytes_s must be > 0")
        moved[traffic.HOST_DEVICE] = traffic.asynchzp_host_device_bytes(t, d_o)["total"]
        seconds += moved[traffic.HOST_DEVICE] / host_device_bw_bytes_s
    return seconds, moved


def _links_text(moved: dict, nics: int, node_size: int) -> str:
    nic = "NIC" if nics == node_size else f"NIC ({nics} per node of {node_size})"
    return (f"whole step: {nic} {moved['nic_busiest'] / 1e9:.3g} GB in {moved['nic_s']:.3g} s, NVLink per rank "
            f"{moved['fabric_busiest'] / 1e9:.3g} GB in {moved['fabric_s']:.3g} s")


def _gib(n: float) -> str:
    return f"{n / BYTES_PER_GB:.2f} GiB"


def _distinct(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` with 4 significant digits, or as many more as it takes to tell them apart (up to 9)."""
    for digits in range(4, 10 if a != b else 5):
        ta, tb = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if ta != tb:
            break
    return ta, tb


def _name(layout: tuple[int, int, int]) -> str:
    return "d_p={}, d_g={}, d_o={}".format(*layout)


def smallest_memory_layout(num_params: int, world: int, node_size: int, *, param_bytes: int = 2,
                           grad_accum_bytes: int = 2, fixed: dict | None = None,
                           offload_optimizer: bool = False, reference_models: int = 0,
                           reference_copies: bool = True) -> tuple[int, int, int, int]:
    """``(d_p, d_g, d_o, bytes)`` of the valid layout agreeing with ``fixed`` whose device bytes
    (:func:`placement_bytes_per_rank`; all model states without offload) are smallest (ties: the smaller host
    bytes, then the smaller sizes); what "auto" would need at least. ValueError if ``fixed`` allows none."""
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    best = None
    for lay in valid_layouts(world, node_size):
        if all(fixed.get(k, v) == v for k, v in zip(SIZE_KEYS, lay)):
            placed = placement_bytes_per_rank(num_params, world, *lay, offload_optimizer=offload_optimizer,
                                              param_bytes=param_bytes, grad_accum_bytes=grad_accum_bytes,
                                              reference_models=reference_models, reference_copies=reference_copies)
            key = (placed["device"]["total"], placed["host"]["total"], lay)
            if best is None or key < best:
                best = key
    if best is None:
        raise ValueError(f"no valid layout of world {world} in nodes of {node_size} agrees with {fixed}")
    return (*best[2], best[0])


def choose_layout(
    num_params: int,
    world: int,
    node_size: int,
    budget_bytes: int | float | None,
    *,
    param_bytes: int = 2,
    grad_accum_bytes: int = 2,
    grad_comm_bytes: int = 2,
    grad_accum_steps: int = 1,
    intra_bw_bytes_s: float = 100e9,
    inter_bw_bytes_s: float = 25e9,
    fixed: dict | None = None,
    offload_optimizer: bool = False,
    nics_per_node: int | None = None,
    reference_models: int = 0,
    reference_copies: bool = True,
) -> tuple[int, int, int, str]:
    """The ``"auto"`` rule: returns ``(d_p, d_g, d_o, reason)``.

    Candidates are :func:`valid_layouts` agreeing with ``fixed`` (``{"param_shard_size": 2, ...}``: the sizes
    the config gives as integers). Those whose model states (:func:`model_state_bytes_per_rank`) fit
    ``budget_bytes`` are ranked by estimated communication seconds per optimizer step
    (:func:`comm_seconds_per_step`: every collective at the pace of its busiest link, NICs at
    ``inter_bw_bytes_s`` each with ``nics_per_node`` per node, a rank's fabric at ``intra_bw_bytes_s``); ties go
    to the layout whose whole-step link times sum less, then to the smaller memory, then to the smaller sizes. ``budget_bytes=None``
    uses :func:`default_budget_bytes`. ``reason`` says, in one or two sentences, how many candidates were
    considered, the winner's memory against the budget and its seconds against the runner-up's.

    With ``offload_optimizer`` (``offload_optimizer.device: "cpu"``) the budget bounds the device bytes of
    :func:`placement_bytes_per_rank` (parameter and gradient shards), which lets a node-local ``d_g`` fit models
    that need ``d_g`` across nodes otherwise; the seconds add the host↔device copies at
    :data:`HOST_DEVICE_BW_BYTES_S` (they shrink as ``d_o`` grows), and ties go to the smaller device bytes,
    then the smaller host bytes. The reason then says that offload was counted, and gives the host bytes.

    ``reference_models`` (``async_hzp.reference_models``) counts that many models of ``num_params`` elements
    without an optimizer: their device bytes (:func:`reference_bytes_per_rank`) join the budget, their forwards'
    gathers the seconds; the reason then names them. ``reference_copies`` False: their engines stay stock's
    (`config_compat.reference_copy_refusal`), partitioned and gathered over the world.

    If no candidate fits, raises AsyncHZPConfigError naming ``async_hzp.memory_budget_gb`` with the bytes the
    smallest-memory candidate needs: silently picking a layout that will run out of memory only moves the
    failure later. If ``fixed`` rules out every layout, raises naming the fixed key.
    """
    from ..errors import AsyncHZPConfigError

    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    unknown = set(fixed) - set(SIZE_KEYS)
    if unknown:
        raise ValueError(f"fixed may only hold {', '.join(SIZE_KEYS)}; got {sorted(unknown)}")
    if intra_bw_bytes_s <= 0 or inter_bw_bytes_s <= 0:
        raise ValueError("bandwidths must be > 0")
    layouts = valid_layouts(world, node_size)
    candidates = [lay for lay in layouts if all(fixed.get(k, v) == v for k, v in zip(SIZE_KEYS, lay))]
    if not candidates:
        # Name the first fixed size that no layout agreeing with the other fixed sizes allows.
        for key in (k for k in SIZE_KEYS if k in fixed):
            others = {k: v for k, v in fixed.items() if k != key}
            allowed = sorted({lay[SIZE_KEYS.index(key)] for lay in layouts
                              if all(others.get(k, v) == v for k, v in zip(SIZE_KEYS, lay))})
            if fixed[key] not in allowed:
                given = ", ".join(f"{k}={v}" for k, v in others.items())
                raise AsyncHZPConfigError(
                    f"async_hzp.{key}",
                    f"is {fixed[key]}, which no valid layout of world {world} in nodes of {node_size} allows"
                    + (f" together with {given}" if given else "") + ' while the other sizes are "auto".',
                    f"set async_hzp.{key} to one of {', '.join(map(str, allowed)) or '(none)'}, or to \"auto\".")
        raise AsyncHZPConfigError("async_hzp", f"no valid layout matches the fixed sizes {fixed}.",
                                  'set the sizes to "auto".')  # pragma: no cover - the loop above names one
    if budget_bytes is None:
        budget_bytes = default_budget_bytes(node_size)

    def placed(lay: tuple[int, int, int]) -> dict:
        return placement_bytes_per_rank(num_params, world, *lay, offload_optimizer=offload_optimizer,
                                        param_bytes=param_bytes, grad_accum_bytes=grad_accum_bytes,
                                        reference_models=reference_models, reference_copies=reference_copies)

    # (layout, device bytes, host bytes); without offload the host holds no model state and the device all.
    fitting = [(lay, p["device"]["total"], p["host"]["total"]) for lay, p in ((lay, placed(lay)) for lay in candidates)]
    fitting = [entry for entry in fitting if entry[1] <= budget_bytes]
    what = "device bytes of model states (optimizer offloaded to the host)" if offload_optimizer else "model states"
    if reference_models:
        what += f" with {reference_models} reference model(s) (async_hzp.reference_models)"
    if not fitting:
        *lay, needed = smallest_memory_layout(num_params, world, node_size, param_bytes=param_bytes,
                                              grad_accum_bytes=grad_accum_bytes, fixed=fixed,
                                              offload_optimizer=offload_optimizer, reference_models=reference_models,
                                              reference_copies=reference_copies)
        lay = tuple(lay)
        needed_gb = math.ceil(needed / BYTES_PER_GB * 100) / 100  # rounded up, so the suggestion really fits
        raise AsyncHZPConfigError(
            "async_hzp.memory_budget_gb",
            f"{what} need {needed} bytes ({needed / BYTES_PER_GB:.2f} GiB) per rank even with the "
            f"smallest-memory layout ({_name(lay)}, of {len(candidates)} considered), but the budget is "
            f"{int(budget_bytes)} bytes ({budget_bytes / BYTES_PER_GB:.2f} GiB).",
            f"raise async_hzp.memory_budget_gb to at least {needed_gb:.2f}, use more ranks"
            + (", relax the sizes given as integers" if fixed else "")
            + ", or use plain ZeRO-3 without async_hzp.")

    def estimate(lay: tuple[int, int, int]) -> tuple[float, dict]:
        return comm_seconds_per_step(num_params, world, node_size, *lay, param_bytes=param_bytes,
                                     grad_comm_bytes=grad_comm_bytes, grad_accum_steps=grad_accum_steps,
                                     intra_bw_bytes_s=intra_bw_bytes_s, inter_bw_bytes_s=inter_bw_bytes_s,
                                     offload_optimizer=offload_optimizer, nics_per_node=nics_per_node,
                                     reference_models=reference_models, reference_copies=reference_copies)

    estimates = {lay: estimate(lay) for lay, _, _ in fitting}   # each layout's links placed once

    def key(lay: tuple[int, int, int]) -> tuple[float, float]:
        # Seconds compared to 9 significant digits: layouts with the same cost on paper must tie, whatever the
        # float rounding of their sums. A tie goes to the layout whose two links' whole-step times sum less.
        total, moved = estimates[lay]
        return float(f"{total:.9g}"), float(f"{moved['nic_s'] + moved['fabric_s']:.9g}")

    ranked = sorted((*key(lay), dev, host, lay) for lay, dev, host in fitting)
    best_s, _, best_dev, best_host, best = ranked[0]
    second_s, _, second_dev, second_host, second = ranked[1] if len(ranked) > 1 else (best_s, 0, None, None, None)
    links_text = _links_text(estimates[best][1], nics_per_node or node_size, node_size)
    best_text, second_text = _distinct(best_s, second_s)
    if not offload_optimizer:
        reason = (f"auto chose {_name(best)} of {len(candidates)} valid layouts ({len(fitting)} fit the budget): "
                  f"model states {_gib(best_dev)} per rank (budget {_gib(budget_bytes)}); estimated communication "
                  f"{best_text} s per optimizer step, each collective at its busiest link's pace ({links_text})")
        runner_up_memory = f"{_gib(second_dev)}" if second is not None else ""
        runner_up_copies = ""
    else:
        def copies(lay: tuple[int, int, int]) -> float:
            return estimates[lay][1][traffic.HOST_DEVICE]   # estimated with offload, as this branch is

        reason = (f"auto chose {_name(best)} of {len(candidates)} valid layouts with optimizer offload taken into "
                  f"account (master weights, moments and fp32 gradients on the host, so the budget bounds the "
                  f"device bytes; {len(fitting)} fit): device {_gib(best_dev)} per rank (budget "
                  f"{_gib(budget_bytes)}), host {_gib(best_host)} per rank ({_gib(best_host * node_size)} per node "
                  f"of {node_size}); estimated communication {best_text} s per optimizer step, the collectives at their "
                  f"busiest links' pace ({links_text}) plus {copies(best) / HOST_DEVICE_BW_BYTES_S:.3g} s of host<->device copies ("
                  f"{copies(best) / 1e9:.3g} GB at {HOST_DEVICE_BW_BYTES_S / 1e9:g} GB/s)")
        runner_up_memory = (f"{_gib(second_dev)} on the device and {_gib(second_host)} on the host"
                            if second is not None else "")
        runner_up_copies = (f" (host<->device {copies(second) / 1e9:.3g} GB)" if second is not None else "")
    if second is None:
        reason += "; no other layout fits."
    elif second_s == best_s:
        reason += f", the same as the runner-up {_name(second)}, which needs {runner_up_memory} per rank."
    else:
        reason += f" vs {second_text} s for the runner-up {_name(second)}{runner_up_copies}."
    if reference_models:
        reason += (f" Counted with {reference_models} reference model(s) of the same size (async_hzp.reference_models"
                   f"): {_gib(placed(best)['device'].get('reference_params', 0))} per rank of the memory above, and "
                   "their forwards' gathers in the time.")
    if offload_optimizer and best[2] < world:
        reason += (f" With d_o={best[2]} < {world} ranks, each of the {world // best[2]} optimizer replicas keeps "
                   f"and steps its own host copy, and copies its own: host<->device bytes are (N/d_o)*(4 + b)/"
                   f"(2*a*A + 4 + b) of stock offload's, {world // best[2]} times those of d_o={world}.")
    logger.debug(reason)
    return (*best, reason)
