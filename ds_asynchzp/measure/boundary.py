"""The optimizer step boundary of one rank and step under optimizer offload: from the return of the window's last
backward to the return of its `engine.step()`, the phases that ran in it (`platform.ledger.boundary_phase`: the
cross-node sum, the copies to the host, the host step, the copies back, the refresh), and the critical path those
phases allow.

The critical path is what the boundary would take if this arm's own phase times were arranged as the dependencies
allow and nothing else waited: the exchange's tail S (the sums' busy time in the window), then the copy to the host
of its last chunk (the window's last copy_out interval: the copies of the others overlap the exchange), then the
training thread's own work in the step (`other`: the window's time in which no phase ran on any thread: the norms,
Stage 3's bookkeeping; work of the training thread that overlapped another thread's phase is not in it, so the path
is a lower bound), then the whole host step H (its pieces run one after another on the host), then the copy back
of the last piece (B / n, n the chunks of the trainable parameter buffer, which the pipeline's pieces follow). The
refresh is not on it: the step returns once the last piece is copied back, and each chunk's refresh runs on after
it, under the next forward. The host step waits for the whole exchange with clipping and without it alike: DeepSpeed 0.19.8 skips
a step whose global gradient norm is not finite in every precision, so no piece may step before the norm is known.
n is the number of chunks of the trainable parameter buffer (the pipeline's pieces). All times are host clocks:
on a CPU rank they are the work itself; on a GPU a copy's interval is its enqueue.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from ..platform.ledger import BOUNDARY_PHASES


def union_seconds(intervals) -> float:
    """Length of the union of (start, end) intervals: overlapping ones are counted once (also the timeline's)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def boundary_chunks(engine) -> Optional[int]:
    """Chunks of the trainable parameter buffer of an AsyncHZP engine's dense family (None for stock)."""
    dense = getattr(engine.optimizer, "hzp_dense", None)
    if dense is None or dense.trainable is None:
        return None
    return len(dense.boundary.chunk_ends(dense.trainable))


def boundary_record(start: float, end: float, phases: List[tuple], chunks: Optional[int]) -> Dict:
    """One step's boundary: `phases` are (start, end, kind, thread) clipped to [start, end)."""
    busy = {kind: union_seconds([(s, e) for s, e, k, _ in phases if k == kind]) for kind in BOUNDARY_PHASES}
    wall = end - start
    other = max(0.0, wall - union_seconds([(s, e) for s, e, _, _ in phases]))
    copies_out = [(e, e - s) for s, e, k, _ in phases if k == "copy_out"]
    last_copy_out = max(copies_out)[1] if copies_out else 0.0
    critical = None
    if chunks:
        critical = busy["sum"] + last_copy_out + other + busy["host_step"] + busy["copy_back"] / chunks
    return {"wall_s": wall, "phase_s": busy, "other_s": other, "chunks": chunks, "critical_path_s": critical}


__all__ = ["boundary_chunks", "boundary_record", "union_seconds"]
