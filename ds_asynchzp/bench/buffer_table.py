"""The report's "package buffers per rank" table: the memory AsyncHZP's own buffers take beyond the model states
(`HierarchicalZeroOptimizer.hzp_buffer_bytes`, recorded by each rank at the end of the measured steps), by kind,
next to the model-state bytes of the same rank. The GPU check shows the same kinds (`KIND_LABELS`, `KIND_LEGEND`).
"""

from __future__ import annotations

from .table import MB, markdown_table

# Kind (`runtime.buffer_bytes.KINDS`) -> its column title, in the order shown.
KIND_LABELS = {
    "gathered_params_owned": "gather pool owned",
    "gathered_params_in_use": "pool in use",
    "gathered_params_peak_in_use": "pool peak in use",
    "grad_staging": "grad staging ring",
    "gather_scratch": "gather scratch",
    "reduce_scratch": "reduce scratch",
    "boundary_scratch": "boundary scratch",
    "error_feedback": "error feedback",
    "host_copy_staging": "host-copy fp32",
}

KIND_LEGEND = (
    "Gather pool owned: the buffers full parameters are gathered into for compute (`BufferPool`), per size class "
    "as many as were in use at once during the last optimizer step (each less than twice its request), trimmed "
    "once per step; pool in use: those handed out when measured "
    "(persistent parameters stay gathered); pool peak in use: the most handed out at once, what the run needed of "
    "what the pool keeps. "
    "Grad staging ring: the reduce flow's 4 send slots (`StagingRing`), each as large as the largest gradient "
    "bucket of the last step or this one, laid out for the d_g members in the communication dtype. "
    "Gather scratch: the gather flow's send and receive buffers, as large as the largest (coalesced) gather of the last step or this one. "
    "Reduce scratch: each family's receive buffer of its bucket reductions, its largest bucket's share. "
    "Boundary scratch: the step boundary's buffers for one column chunk of the cross-node gradient sum and of the "
    "parameter refresh. "
    "Error feedback: the fp32 residual of the quantized cross-node gradient exchange, gradient-shard shaped (only "
    "with `error_feedback`; the model-state table lists it as a role, this table's model-state column leaves it "
    "out). "
    "Host-copy fp32: with optimizer offload, the largest transient fp32 cast of a chunk's own columns before its "
    "copy to the host, computed as the widest gradient chunk x 4 bytes (0 for an fp32 gradient shard, copied as "
    "it is). "
    "Total: the pool's owned bytes (in use and peak are parts of it) plus every other kind.")


def buffer_cells(buffers: dict, unit: float = MB, spec: str = ".3f") -> list[str]:
    """One cell per kind (`KIND_LABELS`) and the total, in `unit`; "n/a" for a kind the rank did not record."""
    return ["n/a" if buffers.get(kind) is None else format(buffers[kind] / unit, spec)
            for kind in (*KIND_LABELS, "total")]


def _model_states(entry: dict) -> float | None:
    """Rank 0's model-state bytes without the error-feedback residual, which this table counts as a buffer."""
    states = entry.get("model_state_bytes") or {}
    if states.get("total") is None:
        return None
    return states["total"] - (states.get("error_feedback") or 0)


def format_buffer_table(arms: dict) -> list[str]:
    """Markdown lines of the section; empty when no arm recorded its package buffers (stock arms, older runs)."""
    recorded = {arm: e for arm, e in arms.items() if e.get("package_buffer_bytes")}
    if not recorded:
        return []
    header = ["arm", *(f"{label} MB" for label in KIND_LABELS.values()), "total MB", "total, largest rank MB",
              "model states MB", "buffers / model states"]
    rows = [header]
    for arm, entry in recorded.items():
        buffers = entry["package_buffer_bytes"]
        by_rank = entry.get("package_buffer_bytes_total_by_rank")
        states = _model_states(entry)
        rows.append([arm, *buffer_cells(buffers), "n/a" if not by_rank else f"{max(by_rank) / MB:.3f}",
                     "n/a" if states is None else f"{states / MB:.3f}",
                     f"{buffers['total'] / states:.3f}" if states else "n/a"])
    stock = [arm for arm in arms if arm not in recorded]
    return ["## Package buffers per rank", "", *markdown_table(rows), "",
            "Memory AsyncHZP's own buffers take on rank 0 beyond the model states, by kind, read from their owners at "
            "the end of the measured steps (`HierarchicalZeroOptimizer.hzp_buffer_bytes`); the largest rank's total "
            "beside it, and rank 0's model states (docs/ARCHITECTURE.md, \"Memory beyond model states\"). MB = 10^6 "
            "bytes. " + KIND_LEGEND
            + (f" Not shown: {', '.join(stock)} (stock DeepSpeed's own buffers, such as its gradient buckets, are "
               "not measured here)." if stock else ""), ""]
