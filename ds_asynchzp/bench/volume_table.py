"""ZeRO++'s volume table from the ledger: cross-node bytes per rank per optimizer step of each flow (forward gather,
backward gather, gradient reduction, AsyncHZP's parameter refresh), measured (``bytes_per_step_by_flow``) next to
the planner's formulas (`planner.volume`), and ZeRO++'s published accounting for zero3 and zeropp."""

from __future__ import annotations

from ..formulas import traffic
from ..planner import volume
from .plan_check import check_results
from .table import MB


def format_measured_flow_table(results: dict) -> list[str]:
    """Cross-node and intra-node bytes by flow as the ledger measured them, without formulas: for runs whose model
    the planner does not know (asynchzp-ab on a user's job)."""
    flows = list(volume.TABLE_FLOWS)
    arms = results.get("arms") or {}
    for entry in arms.values():
        flows += [f for f in (entry.get("bytes_per_step_by_flow") or {}) if f not in flows]
    header = ["arm", *(f"{f} inter / intra MB" for f in flows), "inter total MB"]
    lines = ["## Bytes by flow (measured)", "",
             "Per rank per optimizer step, from the ledger (ring model, quantization scales included), between nodes "
             "/ inside a node; a gather counts in the phase it was issued in. No formulas: the model is the "
             "script's.", "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for arm, entry in arms.items():
        by_flow = entry.get("bytes_per_step_by_flow") or {}
        cells = [f"{(by_flow.get(f) or {}).get('inter_node', 0.0) / MB:.3f} / "
                 f"{(by_flow.get(f) or {}).get('intra_node', 0.0) / MB:.3f}" for f in flows]
        total = sum((v or {}).get("inter_node", 0.0) for v in by_flow.values())
        lines.append("| " + " | ".join([arm, *cells, f"{total / MB:.3f}"]) + " |")
    return lines + [""]


def volume_rows(results: dict) -> tuple[list[dict], dict]:
    """One row per arm with measured and predicted bytes by flow; and the check report they came from."""
    report = check_results(results)
    rows: dict[str, dict] = {}
    for r in report["rows"]:
        if not r["quantity"].startswith("inter_node "):
            continue
        flow = r["quantity"][len("inter_node "):]
        row = rows.setdefault(r["arm"], {"arm": r["arm"], "measured": {}, "predicted": {}, "ok": True})
        row["measured"][flow], row["predicted"][flow] = r["measured"], r["predicted"]
        row["ok"] = row["ok"] and r["ok"]
    return list(rows.values()), report


def _scale_bytes(results: dict, arm: str, flows) -> float | None:
    """Cross-node bytes of quantization scales per rank per optimizer step; None from results that predate
    the split."""
    by_flow = (results.get("arms", {}).get(arm) or {}).get("bytes_per_step_by_flow") or {}
    recorded = [by_flow[f]["inter_node_scales"] for f in flows if "inter_node_scales" in (by_flow.get(f) or {})]
    return sum(recorded) if recorded else None


def _published(arm: str, report: dict, dtype_bytes: float) -> dict | None:
    inp, el = report["inputs"], report["elements"]
    t = traffic.TrafficInputs(world=inp["world"], node_size=inp["node_size"], grad_accum=inp["grad_accum"],
                              gathered_elements=el["gathered"], reduced_elements=el["reduced"],
                              trainable_elements=el["trainable"], param_bytes=dtype_bytes,
                              grad_comm_bytes=dtype_bytes)
    return volume.published_flows(arm, t)


def format_volume_table(results: dict) -> list[str]:
    """Markdown lines: the table, and each arm's ratio to zero3 per micro-step; empty when no arm recorded flows."""
    from ..planner.arm_formulas import DTYPE_BYTES

    rows, report = volume_rows(results)
    if not rows:
        return []
    grad_accum = report["inputs"]["grad_accum"]
    flows = volume.TABLE_FLOWS
    header = ["arm", *(f"{f} MB" for f in flows), "total MB", "of which scales MB", "vs zero3", "payload vs zero3",
              "formulas"]
    totals = {row["arm"]: sum(row["measured"].values()) for row in rows}
    scales = {row["arm"]: _scale_bytes(results, row["arm"], flows) for row in rows}
    lines = ["## Cross-node volume by flow (ZeRO++'s table)", "",
             "Per rank per optimizer step, measured by the ledger (ring model, payload and quantization scales "
             "together) / predicted by the planner's formulas (`planner/volume.py`); a gather counts in the phase "
             f"it was issued in. {grad_accum} micro-steps per optimizer step. The scales are measured apart: "
             "stock ZeRO++ sends them as fp32 collectives of their own, AsyncHZP packs them into each quantized "
             "row (one fp32 scale per block). The ratios to zero3 are the same per optimizer step and per "
             "micro-step (every arm has the same micro-steps).", "",
             "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    ref = totals.get("zero3")
    for row in rows:
        arm = row["arm"]
        cells = [f"{row['measured'].get(f, 0.0) / MB:.3f} / {row['predicted'].get(f, 0.0) / MB:.3f}" for f in flows]
        ratio = f"{totals[arm] / ref:.3f}" if ref else "n/a"
        known = scales[arm] is not None and scales.get("zero3") is not None
        payload_ratio = (f"{(totals[arm] - scales[arm]) / (ref - scales['zero3']):.3f}" if ref and known
                         else "n/a")
        scale_cell = "not recorded" if scales[arm] is None else f"{scales[arm] / MB:.3f}"
        lines.append("| " + " | ".join([arm, *cells, f"{totals[arm] / MB:.3f}", scale_cell, ratio, payload_ratio,
                                          "within 5 %" if row["ok"] else "**off by more than 5 %**"]) + " |")
    b = DTYPE_BYTES.get(report["inputs"]["dtype"], 4)
    published = {arm: _published(arm, report, b) for arm in ("zero3", "zeropp")}
    if all(published.values()):
        per_micro = {arm: sum(v.values()) for arm, v in published.items()}
        lines += ["", "ZeRO++'s published accounting in this run's element counts (qwZ INT8 once per step, hpZ 0, "
                  "qgZ INT4 of a full reduce-scatter per micro-step): zero3 "
                  f"{per_micro['zero3'] / MB:.3f} MB, zeropp {per_micro['zeropp'] / MB:.3f} MB per optimizer step "
                  f"(ratio {per_micro['zeropp'] / per_micro['zero3']:.3f}; 0.25 with one micro-step). Stock qgZ's "
                  "cross-node hop sends only the node-reduced 1/G slice, so it crosses less than the paper counts; "
                  "the formulas above follow the implementation."]
    return lines + [""]
