"""The report's table of the optimizer step boundary under offload (`measure.boundary`): per offload arm the
boundary's wall time, the critical path its own phase times allow, and each phase's busy time, beside the median
step of every arm of the run."""

from __future__ import annotations

from ..platform.ledger import BOUNDARY_PHASES
from .offload import _table, is_offload_arm


def _s(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _ratio(value, reference) -> str:
    return f"{value / reference:.3f}" if value is not None and reference else "n/a"


def _host_step(results: dict, arm: str) -> str:
    """How the arm's optimizer steps: on the device, or on the host whole or in pieces (`offload_pipeline`)."""
    if not is_offload_arm(results, arm):
        return "on the device"
    if not arm.startswith("asynchzp"):
        return "host, stock"
    overrides = (((results.get("config") or {}).get("arm_specs") or {}).get(arm) or {}).get("overrides") or {}
    return "host, whole" if overrides.get("offload_pipeline") is False else "host, in pieces"


def format_boundary_table(results: dict) -> list[str]:
    """Markdown lines; empty without an offload arm that recorded its step boundary (arms without offload record
    theirs too, shown beside offload arms for comparison)."""
    arms = results.get("arms") or {}
    measured = {a: e for a, e in arms.items() if e.get("boundary_wall_s") is not None}
    if not any(is_offload_arm(results, a) for a in measured):
        return []
    serial = [e for a, e in measured.items() if _host_step(results, a) == "host, whole"]
    reference = serial[0] if serial else {}
    header = ["arm", "host step", "median step s", "boundary wall s", "critical path s",
              "wall / serial's critical path", "after exchange s", "its critical path s",
              "after exchange / serial's", *(f"{k} s" for k in BOUNDARY_PHASES), "other s"]
    rows = []
    for arm, entry in arms.items():
        phases = entry.get("boundary_phase_s") or {}
        wall, after = entry.get("boundary_wall_s"), entry.get("boundary_after_exchange_s")
        rows.append([arm, _host_step(results, arm),
                     _s(entry.get("median_step_time_s")), _s(wall), _s(entry.get("boundary_critical_path_s")),
                     _ratio(wall, reference.get("boundary_critical_path_s")), _s(after),
                     _s(entry.get("boundary_after_exchange_critical_path_s")),
                     _ratio(after, reference.get("boundary_after_exchange_critical_path_s")),
                     *(_s(phases.get(k)) for k in BOUNDARY_PHASES), _s(entry.get("boundary_other_s"))])
    clip = (results.get("config") or {}).get("gradient_clipping", "?")
    return ["## Optimizer offload: the step boundary", "",
            *_table(header, rows), "",
            "Seconds, slowest rank per steady step, median over steps (then over repeats). Boundary wall: from the "
            "return of the window's last backward to the return of its `engine.step()`. Phases (busy time inside "
            "that window, host clocks: `platform.ledger.boundary_phase`): sum = the cross-node gradient sum of the "
            "chunks, copy_out = their copies to the host, host_step = the host optimizer (scaling and "
            "DeepSpeedCPUAdam), copy_back = the stepped parameters' copies to the device, refresh = the parameter "
            "refresh of the chunks; other = the window's time in which none ran (norms, Stage 3's bookkeeping). "
            "Critical path (`measure.boundary`): sum + the last chunk's copy_out + other + host_step + copy_back / n, "
            "n = the chunks of the parameter buffer: the order the dependencies allow when the arm's own phase "
            "times are arranged ideally (a lower bound: training-thread work under another thread's phase is not "
            "in other); the host step waits for the whole exchange with and without clipping (DeepSpeed "
            "0.19.8 skips a step whose global norm is not finite in every precision), and the refresh runs on "
            "after the step returns. wall / serial's critical path: against the arm whose host step runs whole. After "
            "exchange: the same window less the sums' busy time in it (they come first), and its critical path "
            "likewise: what the host step, the copies and the step's own work take once the gradients are summed, "
            "the part the host step's pipeline changes; the sums' tail before it varies from step to step with where "
            "the backward ends, for every arm alike. "
            f"Gradient clipping {clip}. An arm with its optimizer on the device has the same window (its sum and its "
            "step's own work).", ""]


__all__ = ["format_boundary_table"]
