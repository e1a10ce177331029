"""Analytic per-rank memory model for AsyncHZP and the ``"auto"`` shard-size rule.

AsyncHZP keeps three groups of sizes ``d_p | d_g | d_o | world``:

* ``d_p`` ranks hold one working shard of the low-precision parameters
  (gathered inside a node before forward/backward),
* ``d_g`` ranks hold one shard of the accumulated gradients,
* ``d_o`` ranks hold one shard of the fp32 master weights and optimizer states.

DeepSpeed's own ZeRO-3 partition (``1/world`` of every parameter) stays the
source of truth, so it is counted on top of the working shard.

All byte counts are for *model states only*: activations, communication
buckets, temporary gather buffers and allocator fragmentation are not
modelled, which is why the default budget below is only half of the memory.

``num_params`` (Ψ) must already be padded by the caller: ZeRO-3 pads every
parameter to a multiple of the world size, so the padded count is
``sum(ceil(numel / world) * world)`` over all parameters (see
:func:`padded_num_params`). With a padded Ψ every division below is exact.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable

logger = logging.getLogger(__name__)

#: Bytes per "GB" in ``async_hzp.memory_budget_gb``: binary gigabytes (GiB),
#: matching how accelerator memory is reported by drivers and torch.
BYTES_PER_GB = 1 << 30

#: Fraction of the detected memory used as the default budget for model
#: states; the rest is left for activations, gather/communication buffers and
#: fragmentation, which the analytic model does not see.
DEFAULT_BUDGET_FRACTION = 0.5


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in ascending order."""
    if n < 1:
        raise ValueError(f"divisors() needs a positive integer, got {n}")
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if d * d != n]
    return small + large


def padded_num_params(numels: Iterable[int], world: int) -> int:
    """Parameter count after ZeRO-3 padding: each tensor rounded up to ``world``."""
    return sum(-(-int(n) // world) * world for n in numels)


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
    grad_accum_bytes: int = 4,
    master_bytes: int = 4,
    optim_state_bytes: int = 8,
) -> dict[str, int]:
    """Bytes of model states one rank holds for a layout ``(d_p, d_g, d_o)``.

    ``num_params`` is the padded parameter count Ψ (see module docstring).
    Defaults describe bf16/fp16 parameters, fp32 gradient accumulation, fp32
    master weights and Adam (two fp32 moments = 8 bytes per parameter).

    Returns a dict with keys:

    * ``param_shard``: ``param_bytes*Ψ/d_p``, the intra-node working shard;
    * ``param_primary``: ``param_bytes*Ψ/world``, DeepSpeed's own partition;
    * ``grad_shard``: ``grad_accum_bytes*Ψ/d_g``, the accumulation shard;
    * ``grad_primary``: ``4*Ψ/world``, the fp32 gradient partition handed to
      the optimizer;
    * ``master``: ``master_bytes*Ψ/d_o``;
    * ``optimizer_state``: ``optim_state_bytes*Ψ/d_o``;
    * ``total``: the sum of the above.
    """
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    for name, d in (("world", world), ("d_p", d_p), ("d_g", d_g), ("d_o", d_o)):
        if d < 1:
            raise ValueError(f"{name} must be >= 1, got {d}")
    psi = int(num_params)
    parts = {
        "param_shard": _ceil_div(param_bytes * psi, d_p),
        "param_primary": _ceil_div(param_bytes * psi, world),
        "grad_shard": _ceil_div(grad_accum_bytes * psi, d_g),
        "grad_primary": _ceil_div(4 * psi, world),
        "master": _ceil_div(master_bytes * psi, d_o),
        "optimizer_state": _ceil_div(optim_state_bytes * psi, d_o),
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
        from .config import AsyncHZPConfigError

        raise AsyncHZPConfigError(
            "async_hzp.memory_budget_gb",
            "is unset and the memory size of this machine could not be detected.",
            "set async_hzp.memory_budget_gb to the per-rank memory (GiB) available for model states.",
        )
    return int(host / max(node_size, 1) * DEFAULT_BUDGET_FRACTION)


def choose_shard_sizes(
    num_params: int,
    world: int,
    node_size: int,
    budget_bytes: int | float | None,
    param_bytes: int = 2,
) -> tuple[int, int, int]:
    """The ``"auto"`` rule: returns ``(d_p, d_g, d_o)``.

    Candidates are ``d_p = d_g`` over the divisors of ``node_size`` (ascending)
    with ``d_o = world``. The *smallest* group whose model states fit
    ``budget_bytes`` wins: smaller groups mean more replication, hence fewer
    and cheaper collectives. ``budget_bytes=None`` uses
    :func:`default_budget_bytes`.

    If even ``d_p = d_g = node_size`` does not fit, raises AsyncHZPConfigError
    naming ``async_hzp.memory_budget_gb`` with the bytes needed: silently
    picking a layout that will run out of memory only moves the failure later.
    """
    if world < 1 or node_size < 1 or world % node_size != 0:
        raise ValueError(f"node_size ({node_size}) must be >= 1 and divide world ({world})")
    if budget_bytes is None:
        budget_bytes = default_budget_bytes(node_size)

    needed = None
    for d in divisors(node_size):
        needed = model_state_bytes_per_rank(num_params, world, d, d, world, param_bytes=param_bytes)["total"]
        if needed <= budget_bytes:
            logger.debug("auto shard size %d fits: %d <= %d bytes", d, needed, budget_bytes)
            return d, d, world

    from .config import AsyncHZPConfigError

    # Round up so that the suggested budget really fits.
    needed_gb = math.ceil(needed / BYTES_PER_GB * 100) / 100
    raise AsyncHZPConfigError(
        "async_hzp.memory_budget_gb",
        f"model states need {needed} bytes ({needed / BYTES_PER_GB:.2f} GiB) per rank even with "
        f"param/grad shards over the whole node ({node_size} ranks), but the budget is "
        f"{int(budget_bytes)} bytes ({budget_bytes / BYTES_PER_GB:.2f} GiB).",
        f"raise async_hzp.memory_budget_gb to at least {needed_gb:.2f}, use more "
        "ranks, or use plain ZeRO-3 without async_hzp (it shards parameters over the whole world).",
    )
