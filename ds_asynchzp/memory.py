"""Per-rank model-state bytes, measured from the tensors that hold them.

Each storage is counted once (parameter partitions are views into flat buffers; a tied parameter appears once),
so the figure is what the run really allocated for model states, to compare with
`ds_asynchzp.sizing.model_state_bytes_per_rank`. Activations and communication buffers are not model states.
"""

from __future__ import annotations

from .deepspeed_internals import stage3_model_state_tensors
from .param_shards import SHARD_ATTR


def model_state_bytes(engine) -> dict:
    """Bytes per role (param_primary, param_secondary / param_shard, master, optimizer_state, grad_primary,
    grad_shard) and their total, for this rank."""
    optimizer = engine.optimizer
    tensors = stage3_model_state_tensors(optimizer, engine.module)
    shard_params = [p for p in engine.module.parameters() if getattr(p, SHARD_ATTR, None) is not None]
    tensors["param_shard"] = [getattr(p, SHARD_ATTR) for p in shard_params]
    grads = getattr(optimizer, "hzp_grads", None)
    tensors["grad_shard"] = [grads.accum] if grads is not None else []
    seen, out = set(), {}
    for role, role_tensors in tensors.items():
        total = 0
        for tensor in role_tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        out[role] = total
    out["total"] = sum(out.values())
    return out
