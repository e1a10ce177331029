"""A bandwidth sweep: ``asynchzp-bench --network emulated --inter-node-bw 50mbit,200mbit,1gbit,unlimited`` runs every
arm at each link rate, each rate on a freshly built emulated cluster of the same shape, into ``OUT/bw-RATE/`` (a
complete run: results.json, summary, report). Then ``OUT/sweep.json`` lists the runs, ``OUT/sweep.md`` tabulates
tokens/s per arm and rate, the speed-up over the reference arm (zero3) and the planner's predicted step time
(`planner.time_model` through `plan_check.check_sweep`, which needs the unshaped run), and
``OUT/speedup_vs_bandwidth.png`` plots the speed-up against the rate, as ZeRO++'s evaluation does (its Figures 6
to 8).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Callable

from .plan_check import check_sweep, load_sweep
from .table import REFERENCE_ARM

UNSHAPED = "unlimited"


def parse_rates(text: str) -> list[str]:
    """The comma-separated rates of ``--inter-node-bw``, each checked by the emulator's own parser."""
    from ds_asynchzp.netem import parse_rate

    rates = [r.strip() for r in text.split(",") if r.strip()]
    if not rates:
        raise ValueError("--inter-node-bw: no rate given")
    for rate in rates:
        parse_rate(rate)
    if len(set(rates)) != len(rates):
        raise ValueError(f"--inter-node-bw: a rate is listed twice in {text!r}")
    return rates


def rate_dir(rate: str) -> str:
    return f"bw-{rate}"


def run_sweep(args: argparse.Namespace, run_one: Callable[[argparse.Namespace], dict]) -> dict:
    """Run `run_one` (one complete benchmark) at every rate; write sweep.json after each, so a failure keeps the
    rest; then the table and the plot."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sweep = {"rates": list(args.inter_node_bws), "runs": {}, "reference_arm": REFERENCE_ARM}
    for index, rate in enumerate(args.inter_node_bws, 1):
        print(f"\n=== rate {index}/{len(args.inter_node_bws)}: inter-node links {rate} ===", flush=True)
        one = copy.copy(args)
        one.inter_node_bw, one.out = rate, str(out / rate_dir(rate))
        run_one(one)
        sweep["runs"][rate] = f"{rate_dir(rate)}/results.json"
        (out / "sweep.json").write_text(json.dumps(sweep, indent=2) + "\n", encoding="utf-8")
    loaded = load_sweep(out / "sweep.json")
    table = format_sweep(loaded)
    (out / "sweep.md").write_text(table + "\n", encoding="utf-8")
    print("\n" + table, flush=True)
    if not args.no_report:
        if any(REFERENCE_ARM in per for per in step_times(loaded).values()):
            plot_speedup(loaded, out / "speedup_vs_bandwidth.png")
            print(f"plot: {out / 'speedup_vs_bandwidth.png'}", flush=True)
        else:
            print(f"no speed-up plot: the sweep ran no {REFERENCE_ARM} arm to compare with", flush=True)
    return sweep


def step_times(sweep: dict) -> dict:
    """{rate: {arm: median step seconds}} of the arms that ran."""
    return {rate: {arm: e["median_step_time_s"] for arm, e in res["arms"].items()
                   if e.get("median_step_time_s") is not None}
            for rate, res in sweep["results"].items()}


def format_sweep(sweep: dict) -> str:
    times = step_times(sweep)
    arms = list(dict.fromkeys(a for per_rate in times.values() for a in per_rate))
    any_results = next(iter(sweep["results"].values()))
    tokens = any_results["config"]["tokens_per_optimizer_step"]
    preset = any_results["config"].get("zero3_knobs")
    lines = [f"Bandwidth sweep (`--zero3-knobs {preset}`): tokens/s (all ranks) per arm and inter-node rate; in "
             f"brackets the speed-up over {REFERENCE_ARM} at the same rate.", ""]
    header = ["rate", *arms]
    rows = []
    for rate, per_arm in times.items():
        ref = per_arm.get(REFERENCE_ARM)
        cells = []
        for arm in arms:
            t = per_arm.get(arm)
            cells.append("n/a" if t is None else f"{tokens / t:.0f}" + (f" ({ref / t:.2f}x)" if ref else ""))
        rows.append([rate, *cells])
    lines += _md(header, rows)
    check = check_sweep(sweep)
    lines += ["", "Step time, measured against the planner's time model (`planner/time_model.py`: from the unshaped "
                  "step, the cross-node communication the training thread waited for takes the longer of its "
                  "unshaped time and the node link's time for the step's bytes; AsyncHZP's threads hide up to one "
                  "micro-step of it):", ""]
    lines += _md(["rate", "arm", "measured s", "predicted s", "diff", ""],
                 [[r["rate"], r["arm"], f"{r['measured']:.3f}", f"{r['predicted']:.3f}", f"{r['rel_diff']:+.1%}",
                   "ok" if r["ok"] else "MISS"] for r in check["rows"]])
    lines += [f"note: {n}" for n in check["notes"]]
    return "\n".join(lines)


def _md(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def plot_speedup(sweep: dict, path: Path) -> None:
    from ds_asynchzp.netem import parse_rate

    from .report import _new_figure, _style

    times = step_times(sweep)
    shaped = [(parse_rate(rate), rate) for rate in times if parse_rate(rate) is not None]
    shaped.sort()
    arms = [a for a in dict.fromkeys(a for per in times.values() for a in per) if a != REFERENCE_ARM]
    fig, axes = _new_figure(1, 1, (7.0, 4.5))
    ax = axes[0][0]
    for arm in arms:
        xs = [bits / 1e6 for bits, rate in shaped if arm in times[rate] and REFERENCE_ARM in times[rate]]
        ys = [times[rate][REFERENCE_ARM] / times[rate][arm] for bits, rate in shaped
              if arm in times[rate] and REFERENCE_ARM in times[rate]]
        color, style, width = _style(arm, arms)
        ax.plot(xs, ys, style, color=color, linewidth=width, marker="o", label=arm)
        if UNSHAPED in times and arm in times[UNSHAPED] and REFERENCE_ARM in times[UNSHAPED]:
            ax.axhline(times[UNSHAPED][REFERENCE_ARM] / times[UNSHAPED][arm], color=color, linestyle=":",
                       linewidth=1.0)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("inter-node link rate (Mbit/s); dotted: unshaped links")
    ax.set_ylabel(f"speed-up over {REFERENCE_ARM} (step time ratio)")
    ax.legend()
    fig.savefig(path, dpi=120)
