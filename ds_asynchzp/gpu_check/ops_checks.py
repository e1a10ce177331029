"""The GPU check's ops sections: every compiled op against its reference over random layouts and alignments, and
the ops' bandwidth against a device copy and DeepSpeed's quantizer kernels, with the goals the kernels are built to.

Goals (kernel time from CUDA graph replays, at the largest size measured, 64 MiB by default): copy-type ops (pack,
unpack, unpack_gathered, bucket_add) at least 0.85 of a device copy of the same bytes; quantize at least DeepSpeed's
quantizer's fraction of a copy; dequantize at least DeepSpeed's dequantizer's, or 0.8 of a copy; at 1 MiB, the host's
part of a call under 20 µs. They are measurements: a goal missed is reported, and fails no check.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

COPY_TYPE = ("pack", "unpack", "unpack_gathered", "bucket_add")
COPY_GOAL, DEQUANTIZE_COPY_GOAL, HOST_GOAL_US = 0.85, 0.8, 20.0
SMALL_SIZE = 1 << 20


def check_conformance(device, cases: int, progress: Callable[[str], None]) -> Dict:
    """Bit for bit against the reference (NaN payloads aside), on random layouts, sizes and alignments."""
    from ..ops import builder, conformance

    status = builder.status(device.type)
    if not status.compiled:
        return {"name": "ops against reference", "passed": False,
                "summary": f"the compiled ops are not in use on {device.type}: {status}", "details": {}}
    result = conformance.summary(conformance.run(device, cases=cases, seed=0, progress=progress))
    wrong = [f"{r['op']} {r['dtype']} ({r['mismatches']} of {r['calls']})" for r in result["rows"] if r["mismatches"]]
    return {"name": "ops against reference", "passed": result["passed"],
            "summary": f"{result['calls']} calls of every op on {cases} random layouts and as many quantization "
                       "cases (any alignment, runs shorter than a word and longer than many tiles, inf/NaN/subnormal "
                       "blocks), each output bit for bit against the pure-torch reference: "
                       + (f"differ: {', '.join(wrong)}" if wrong else "all equal"),
            "details": {"rows": result["rows"], "first mismatches": result["first_mismatches"],
                        "status": str(status)}}


def _ratio(row: Dict) -> Optional[float]:
    return row["gbps"] / row["copy_gbps"] if row.get("gbps") and row.get("copy_gbps") else None


def goal_rows(rows: List[Dict]) -> List[Dict]:
    """One row per op and dtype at the largest size: its goal, the figure, and whether it was met."""
    largest = max((r["size_bytes"] for r in rows), default=0)
    deepspeed = {r["op"]: _ratio(r) for r in rows if r["op"].endswith("[deepspeed]") and r["size_bytes"] == largest}
    goals = []
    for r in rows:
        op = r["op"]
        if op.endswith("[deepspeed]"):
            continue
        if r["size_bytes"] == SMALL_SIZE and r.get("host_us") is not None:
            goals.append({"op": op, "dtype": r["dtype"], "size": "1 MiB", "figure": "host µs per call",
                          "value": r["host_us"], "goal": f"< {HOST_GOAL_US:g}", "met": r["host_us"] < HOST_GOAL_US})
        if r["size_bytes"] != largest:
            continue
        ratio = _ratio(r)
        if op in COPY_TYPE:
            goal, bound = f">= {COPY_GOAL}", COPY_GOAL
        elif op.startswith("quantize"):
            bound = deepspeed.get("quantize8[deepspeed]")
            goal = "DeepSpeed's quantizer" + (f" ({bound:.2f})" if bound else ": not measured")
        elif op.startswith("dequantize"):
            ds = deepspeed.get("dequantize8[deepspeed]")
            bound = min(ds, DEQUANTIZE_COPY_GOAL) if ds else DEQUANTIZE_COPY_GOAL
            goal = f">= DeepSpeed's dequantizer ({ds:.2f}) or {DEQUANTIZE_COPY_GOAL}" if ds else \
                f">= {DEQUANTIZE_COPY_GOAL}"
        else:
            continue
        goals.append({"op": op, "dtype": r["dtype"], "size": f"{largest >> 20} MiB", "figure": "kernel / copy",
                      "value": ratio, "goal": goal,
                      "met": None if ratio is None or bound is None else ratio >= bound})
    return goals


def bench_ops(device, sizes: List[str], min_time: float) -> List[Dict]:
    """The bandwidth table and the goals, two measured entries."""
    from ..ops import bench

    rows = bench.run(bench.OPS, list(bench.DTYPES), [bench.parse_size(s) for s in sizes], device, min_time=min_time)
    module, reason = bench.deepspeed_quantizer(device)
    for size in sizes:
        rows += bench.deepspeed_rows(module, reason, bench.parse_size(size), device)
    table = [{"op": r["op"], "dtype": r["dtype"], "size": bench.human(r["size_bytes"]), "kernel GB/s": r["gbps"],
              "copy GB/s": r["copy_gbps"], "kernel / copy": _ratio(r), "whole-op GB/s": r.get("whole_gbps"),
              "latency µs": r.get("latency_us"), "host µs": r.get("host_us"), "note": r.get("note", "")}
             for r in rows]
    goals = goal_rows(rows)
    missed = [f"{g['op']} {g['dtype']} ({g['figure']} {g['value']:.3g}, goal {g['goal']})" for g in goals
              if g["met"] is False]
    cuda = device.type == "cuda"
    legend = ("kernel: device time per call from CUDA events around replays of a CUDA graph of back-to-back calls; "
              "copy: `dst.copy_(src)` of the same bytes read plus written, timed the same way; whole-op: wall time "
              "per call of back-to-back calls ending in one synchronisation; latency: best wall time of one call "
              "and a synchronisation; host: the host's time to issue one call. GB/s count bytes read plus written."
              if cuda else "CPU dry run: best wall time of one call (no kernel/host split on CPU).")
    return [{"name": "ops bandwidth", "passed": None, "measured": True,
             "summary": "each op's kernel and whole-op bandwidth against a device copy of the same bytes, and "
                        "DeepSpeed's quantizer and dequantizer" + ("" if module is not None else f" ({reason})"),
             "details": {"rows": table, "legend": legend}},
            {"name": "ops goals", "passed": None, "measured": True,
             "summary": (f"{sum(g['met'] is True for g in goals)} of {len(goals)} met"
                         + (f"; missed: {'; '.join(missed)}" if missed else "")) if cuda
             else "not measured on CPU (the goals are for CUDA kernels)",
             "details": {"rows": goals if cuda else [], "legend": __doc__.split("\n\n")[1].replace("\n", " ")}}]
