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
:mod:`ds_asynchzp.accounting.traffic`; the reason string it returns names the numbers behind the choice.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable

from . import traffic

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
                          intra_bw_bytes_s: float, inter_bw_bytes_s: float) -> tuple[float, dict]:
    """Estimated communication seconds per optimizer step of one layout, and its ``{"intra_node",
    "inter_node"}`` bytes: every element gathered, reduced and trained (P_g = P_r = P_t = Ψ), no overlap."""
    t = traffic.TrafficInputs(world=world, node_size=node_size, grad_accum=grad_accum_steps,
                              gathered_elements=num_params, reduced_elements=num_params,
                              trainable_elements=num_params, param_bytes=param_bytes, grad_comm_bytes=grad_comm_bytes)
    moved = traffic.asynchzp_bytes(t, d_p, d_g, d_o)
    return moved["intra_node"] / intra_bw_bytes_s + moved["inter_node"] / inter_bw_bytes_s, moved


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
                           grad_accum_bytes: int = 2, fixed: dict | None = None) -> tuple[int, int, int, int]:
    """``(d_p, d_g, d_o, bytes)`` of the valid layout agreeing with ``fixed`` whose model states are smallest
    (ties: the smaller sizes); what "auto" would need at least. ValueError if ``fixed`` allows none."""
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    best = None
    for lay in valid_layouts(world, node_size):
        if all(fixed.get(k, v) == v for k, v in zip(SIZE_KEYS, lay)):
            mem = model_state_bytes_per_rank(num_params, world, *lay, param_bytes=param_bytes,
                                             grad_accum_bytes=grad_accum_bytes)["total"]
            if best is None or (mem, lay) < (best[3], best[:3]):
                best = (*lay, mem)
    if best is None:
        raise ValueError(f"no valid layout of world {world} in nodes of {node_size} agrees with {fixed}")
    return best


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
) -> tuple[int, int, int, str]:
    """The ``"auto"`` rule: returns ``(d_p, d_g, d_o, reason)``.

    Candidates are :func:`valid_layouts` agreeing with ``fixed`` (``{"param_shard_size": 2, ...}``: the sizes
    the config gives as integers). Those whose model states (:func:`model_state_bytes_per_rank`) fit
    ``budget_bytes`` are ranked by estimated communication seconds per optimizer step
    (:func:`comm_seconds_per_step`: intra-node bytes / ``intra_bw_bytes_s`` + inter-node bytes /
    ``inter_bw_bytes_s``); ties go to the smaller memory, then to the smaller sizes. ``budget_bytes=None``
    uses :func:`default_budget_bytes`. ``reason`` says, in one or two sentences, how many candidates were
    considered, the winner's memory against the budget and its seconds against the runner-up's.

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

    def memory(lay: tuple[int, int, int]) -> int:
        return model_state_bytes_per_rank(num_params, world, *lay, param_bytes=param_bytes,
                                          grad_accum_bytes=grad_accum_bytes)["total"]

    fitting = [(lay, memory(lay)) for lay in candidates]
    fitting = [(lay, mem) for lay, mem in fitting if mem <= budget_bytes]
    if not fitting:
        *lay, needed = smallest_memory_layout(num_params, world, node_size, param_bytes=param_bytes,
                                              grad_accum_bytes=grad_accum_bytes, fixed=fixed)
        lay = tuple(lay)
        needed_gb = math.ceil(needed / BYTES_PER_GB * 100) / 100  # rounded up, so the suggestion really fits
        raise AsyncHZPConfigError(
            "async_hzp.memory_budget_gb",
            f"model states need {needed} bytes ({needed / BYTES_PER_GB:.2f} GiB) per rank even with the "
            f"smallest-memory layout ({_name(lay)}, of {len(candidates)} considered), but the budget is "
            f"{int(budget_bytes)} bytes ({budget_bytes / BYTES_PER_GB:.2f} GiB).",
            f"raise async_hzp.memory_budget_gb to at least {needed_gb:.2f}, use more ranks"
            + (", relax the sizes given as integers" if fixed else "")
            + ", or use plain ZeRO-3 without async_hzp.")

    def seconds(lay: tuple[int, int, int]) -> float:
        return comm_seconds_per_step(num_params, world, node_size, *lay, param_bytes=param_bytes,
                                     grad_comm_bytes=grad_comm_bytes, grad_accum_steps=grad_accum_steps,
                                     intra_bw_bytes_s=intra_bw_bytes_s, inter_bw_bytes_s=inter_bw_bytes_s)[0]

    # Seconds compared to 9 significant digits: layouts with the same cost on paper must tie (then less memory
    # wins), whatever the float rounding of their sums.
    ranked = sorted((float(f"{seconds(lay):.9g}"), mem, lay) for lay, mem in fitting)
    best_s, best_mem, best = ranked[0]
    second_s, second_mem, second = ranked[1] if len(ranked) > 1 else (best_s, None, None)
    best_text, second_text = _distinct(best_s, second_s)
    reason = (f"auto chose {_name(best)} of {len(candidates)} valid layouts ({len(fitting)} fit the budget): "
              f"model states {_gib(best_mem)} per rank (budget {_gib(budget_bytes)}); estimated communication "
              f"{best_text} s per optimizer step")
    if second is None:
        reason += "; no other layout fits."
    elif second_s == best_s:
        reason += f", the same as the runner-up {_name(second)}, which needs {_gib(second_mem)} per rank."
    else:
        reason += f" vs {second_text} s for the runner-up {_name(second)}."
    logger.debug(reason)
    return (*best, reason)
