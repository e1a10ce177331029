"""Per-rank model-state bytes, measured from the tensors that hold them.

Each storage is counted once, under the first role that holds it: AsyncHZP's shard buffers come first, so
DeepSpeed's partitions that are views into them (its flat parameter buffer, its gradient partitions) add
nothing, which is exactly what the placement promises. The figure is what the run really allocated for model
states, to compare with `ds_asynchzp.formulas.sizing.model_state_bytes_per_rank`. Activations and
communication buffers are not model states.
"""

from __future__ import annotations

from ..platform.deepspeed_internals import stage3_model_state_tensors


def model_state_bytes(engine) -> dict:
    """Bytes per role and their total, for this rank.

    Roles: `param_shard`, `grad_shard` (AsyncHZP's buffers); `error_feedback` (the quantized gradient exchange's
    residual, only with `error_feedback`); `param_primary`, `param_secondary`, `grad_primary` (DeepSpeed's own
    partitions, where they are not views into ours); `master`, `optimizer_state` (fp32 master weights and
    optimizer moments).
    """
    optimizer = engine.optimizer
    tensors = {}
    placements = getattr(optimizer, "hzp_placements", None)
    if placements is not None:
        tensors["param_shard"] = [buffer.data for p in placements for buffer in p.shards.buffers]
        tensors["grad_shard"] = [p.grads.buffer.data for p in placements if p.grads is not None]
        feedbacks = [p.error_feedback.residual for p in placements if p.error_feedback is not None]
        if feedbacks:
            tensors["error_feedback"] = feedbacks
    tensors.update(stage3_model_state_tensors(optimizer, engine.module))
    seen, out = set(), {}
    for role, role_tensors in tensors.items():
        total = 0
        for tensor in role_tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        out[role] = total
    out["total"] = sum(out.values())
    return out
