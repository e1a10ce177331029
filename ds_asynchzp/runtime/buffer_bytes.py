"""Memory the package's own buffers take per rank, beyond the model states, by kind
(docs/ARCHITECTURE.md, "Memory beyond model states").

The model states (parameter and gradient shards, master weights, optimizer states) are measured by
`measure.memory`; these are the buffers the communication path adds to them. Each is read from the object
that owns it, so the figure is what the run holds, not a formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch

# Kinds in the order reports show them. The pool's "in use" and "peak in use" are parts of what it owns, so the
# total counts the pool once (`HELD`).
KINDS = ("gathered_params_owned", "gathered_params_in_use", "gathered_params_peak_in_use", "grad_staging",
         "gather_scratch", "reduce_scratch", "boundary_scratch", "error_feedback", "host_copy_staging")
HELD = ("gathered_params_owned", "grad_staging", "gather_scratch", "reduce_scratch", "boundary_scratch",
        "error_feedback", "host_copy_staging")


@dataclass(frozen=True)
class BufferOwners:
    """The owners of the package's buffers beyond the model states, as the optimizer holds them
    (`HierarchicalZeroOptimizer.hzp_buffer_owners()`): what this module counts and `buffer_trim` trims."""

    pool: object             # BufferPool: the gathered parameters
    gather: object           # ParamGather: its scratch, and the stream its buffers' readers run on
    gather_runner: object    # the gather flow's runner (its thread, or inline)
    families: tuple          # every family's Placement: its boundary flow (scratch), its error feedback
    trainable: tuple         # the Placements with gradients on this rank: their reduce flow (staging, scratch)
    host_copies: bool        # optimizer offload: a chunk's summed gradients are copied to the host


def _host_copy_staging(owners: BufferOwners) -> int:
    """With optimizer offload, the largest fp32 temporary of a chunk's copy to the host (`comm.host_copy`: the own
    columns cast on the device before the copy): at most the widest gradient chunk's columns x 4 bytes. A gradient
    shard already in fp32 is copied as it is, with no temporary."""
    if not owners.host_copies:
        return 0
    widest = [p.boundary.widest_chunk(p.grads.buffer) for p in owners.trainable
              if p.grads.buffer.data.dtype != torch.float32]
    return max(widest, default=0) * 4


def buffer_bytes(optimizer) -> Dict[str, int]:
    """Bytes per kind (`KINDS`) on this rank, and their "total" (`HELD`)."""
    owners = optimizer.hzp_buffer_owners()
    trainable, pool = owners.trainable, owners.pool
    out = {"gathered_params_owned": pool.owned_bytes, "gathered_params_in_use": pool.in_use_bytes,
           "gathered_params_peak_in_use": pool.peak_in_use_bytes,
           "grad_staging": sum(p.reduce.staging.nbytes() for p in trainable),
           "gather_scratch": owners.gather.scratch.nbytes(),
           "reduce_scratch": sum(p.reduce.scratch.nbytes() for p in trainable),
           "boundary_scratch": sum(p.boundary.scratch.nbytes() for p in owners.families),
           "error_feedback": sum(p.error_feedback.nbytes() for p in owners.families
                                 if p.error_feedback is not None),
           "host_copy_staging": _host_copy_staging(owners)}
    out["total"] = sum(out[kind] for kind in HELD)
    return out


def staging_rings(optimizer) -> List[Dict[str, int]]:
    """Per family with gradients: its staging ring's slots, elements per slot and element size."""
    return [{"slots": ring.slots, "capacity": ring.capacity, "element_size": ring.element_size}
            for ring in (p.reduce.staging for p in optimizer.hzp_buffer_owners().trainable)]


def buffer_allocations(optimizer) -> Dict[str, int]:
    """Buffers the communication path has allocated so far, by pool (constant once warmed up)."""
    owners = optimizer.hzp_buffer_owners()
    trainable = owners.trainable
    return {"gathered_params": owners.pool.allocations,
            "grad_staging": sum(p.reduce.staging.allocations for p in trainable),
            "gather_scratch": owners.gather.scratch.allocations,
            "reduce_scratch": sum(p.reduce.scratch.allocations for p in trainable),
            "boundary_scratch": sum(p.boundary.scratch.allocations for p in owners.families)}
