"""The planner's step-time model on a cluster whose node links run at a given rate (`bench.plan_check` checks it
against a benchmark's bandwidth sweep: `asynchzp-plan --check SWEEP/sweep.json`).

Inputs: each arm's step time with unshaped links (compute, and communication at memory speed), the bytes its
flows put on a node link per optimizer step (one link per node: the ledger's figure of the unshaped run, else
`step_collectives.link_bytes`, per rank, times the ranks of a node; one link per rank, rails: the model's busiest
link, `formulas.links`), times the frame overhead of the link, and the link's rate: ``link_s(rate)``.

An arm that communicates on the training thread (stock ZeRO-3 and ZeRO++ on CPU ranks, whose overlap needs CUDA
streams; AsyncHZP with ``async_comm: false``) waits for its cross-node collectives. Unshaped, they took
``exposed_x``: the training thread's waits while one of its own cross-node collectives was in flight
(``exposed(unshaped) * cross_node_share``, read from the unshaped run's drawn step; the whole exposure where no
timeline was recorded). On CPU ranks that time is gloo's host work (copies, reductions, the TCP stack), not the
link. Shaped, the collective needs both the host work and the link's transfer, and how far they overlap depends
on how gloo pipelines a ring step's chunk against the socket, which the run does not record. So two bounds::

    low  = step(unshaped) - exposed_x + max(exposed_x, link_s)    # host work entirely under the transfer
    high = step(unshaped) + link_s                                # none of it under the transfer

and the prediction is their midpoint (the unknown overlap taken as half). Waits inside a node (hpZ's secondary
gathers, AsyncHZP's micro-step flows) stay as they were in both.

AsyncHZP crosses nodes once per optimizer step, from its boundary thread: the gradient exchange runs under the
last backward and the parameter refresh under the next forward, so about one micro-step of compute hides it::

    predicted = low = step(unshaped) + max(0, link_s - step(unshaped) / A),   high = step(unshaped) + link_s

Both ignore latency (the emulated links add none unless asked) and TCP's ramp-up, which matter for small
messages on slow links.
"""

from __future__ import annotations


def runs_on_threads(arm: str, overrides: dict | None = None) -> bool:
    """Whether the arm's cross-node traffic runs on AsyncHZP's communication threads."""
    base = arm.split(":")[0]
    if not base.startswith("asynchzp") or base == "asynchzp-sync":
        return False
    return (overrides or {}).get("async_comm", True) is not False


def link_seconds(link_bytes_per_rank: float, ranks_per_node: int, rate_bits_s: float | None,
                 overhead: float = 1.0) -> float:
    """Seconds a node's link needs for one optimizer step's bytes (0 on an unshaped link)."""
    if not rate_bits_s:
        return 0.0
    return link_bytes_per_rank * ranks_per_node * overhead * 8.0 / rate_bits_s


def _union(intervals) -> list:
    merged: list = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def cross_node_share(timeline: dict | None) -> float:
    """Of the training thread's waits in a drawn step (`results.json` ``timeline``), the share spent while a
    cross-node collective the training thread issued was in flight; 1.0 without a timeline or waits."""
    if not timeline:
        return 1.0
    waits = _union((w["start"], w["end"]) for w in timeline.get("waits", ()))
    total = sum(end - start for start, end in waits)
    if total <= 0:
        return 1.0
    crossing = _union((c["start"], c["end"]) for c in timeline.get("collectives", ())
                      if c.get("inter_node") and c.get("thread") == "MainThread")
    overlap, i, j = 0.0, 0, 0
    while i < len(waits) and j < len(crossing):
        overlap += max(0.0, min(waits[i][1], crossing[j][1]) - max(waits[i][0], crossing[j][0]))
        if waits[i][1] < crossing[j][1]:
            i += 1
        else:
            j += 1
    return overlap / total


def step_bounds_s(arm: str, unshaped_step_s: float, link_s: float, grad_accum: int,
                  overrides: dict | None = None, unshaped_exposed_s: float = 0.0,
                  crossing_share: float = 1.0) -> tuple[float, float]:
    """(low, high): the step time with the transfer entirely under other work, and with none of it."""
    high = unshaped_step_s + link_s
    if runs_on_threads(arm, overrides):
        return unshaped_step_s + max(0.0, link_s - unshaped_step_s / grad_accum), high
    exposed = min(max(unshaped_exposed_s, 0.0), unshaped_step_s) * min(max(crossing_share, 0.0), 1.0)
    return unshaped_step_s - exposed + max(exposed, link_s), high


def predicted_step_s(arm: str, unshaped_step_s: float, link_s: float, grad_accum: int,
                     overrides: dict | None = None, unshaped_exposed_s: float = 0.0,
                     crossing_share: float = 1.0) -> float:
    """The low bound on AsyncHZP's threads; the midpoint of the bounds on the training thread."""
    low, high = step_bounds_s(arm, unshaped_step_s, link_s, grad_accum, overrides, unshaped_exposed_s,
                              crossing_share)
    return low if runs_on_threads(arm, overrides) else (low + high) / 2
