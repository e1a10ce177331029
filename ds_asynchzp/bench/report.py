"""A self-contained A/B report of one ``asynchzp-bench`` run: ``report.md`` plus four PNG plots.

Every figure in the report is read from results.json or computed from it in the open (ratios, medians, minima);
a formula's figure (the volume table's predictions, stock ZeRO-3's host<->device bytes under offload) is labelled
as one. Optional keys (repeats, network emulation, measured link bytes, exposed and busy
communication time, timelines) are used when present and left out, with a note, when absent, so reports of older
runs still render.

    python -m ds_asynchzp.bench.report bench_out/results.json [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from .buffer_table import format_buffer_table
from .link_table import format_link_table
from .model_table import format_model_table
from .records import read_results
from .report_intro import is_job_run, job_provenance, job_workload, opening
from .timeline_plot import plot_timelines
from .table import (HOST_COLUMNS, LAYOUT_LEGEND, MB, REFERENCE_ARM, host_cells, host_legend, layout_cells,
                    markdown_table, max_rel_loss_diff, memory_roles, role_bytes, shows_host_overhead)

NA = "n/a"
PLOTS = ("loss.png", "bytes.png", "step_time.png", "timeline.png")
ARM_STYLES = {"zero3": ("tab:gray", "-", 3.5), "hpz": ("tab:orange", "--", 2.2), "asynchzp": ("tab:blue", ":", 2.2),
              "asynchzp-sync": ("tab:purple", "-.", 2.2)}
# Colours for the other arms (layout overrides such as asynchzp:param_shard_size=1), none shared with ARM_STYLES.
EXTRA_COLORS = ("tab:green", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
# Collective kinds in a fixed order so colours and table rows match across runs; unknown kinds follow, sorted.
OP_ORDER = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all", "send", "recv")
# Recorded tokens/s and step times describe the same run; anything looser than this means a broken results file.
CONSISTENCY_RTOL = 1e-6


# ------------------------------------------------------------------------------------------------ numbers
# Said in every report: the testbed does not give stock ZeRO-3's overlap what a GPU gives it.
CPU_OVERLAP_CAVEAT = (
    "**CPU testbed caveat.** Stock ZeRO-3 and ZeRO++ overlap communication with compute on CUDA streams "
    "(`overlap_comm`, the coordinator's prefetch); DeepSpeed's CPU accelerator has no streams, so on these CPU "
    "ranks `overlap_comm` does nothing and their collectives are issued on the training thread (the prefetch's "
    "asynchronous gathers still progress on gloo's own threads), while AsyncHZP's run on its own threads. Part of "
    "any speed-up measured here therefore comes from the testbed; the `asynchzp-sync` arm (the "
    "same placement, nothing on threads) against `zero3` isolates what the placement alone gives.")


def _fmt(value, spec: str) -> str:
    return NA if value is None else format(value, spec)


def _mb(nbytes) -> str:
    if nbytes is None:
        return NA
    # Non-zero traffic (a scalar all-reduce) must not read as "0.000": that would claim no traffic at all.
    return "<0.001" if 0 < nbytes < 0.0005 * MB else f"{nbytes / MB:.3f}"


def _ratio(value, reference) -> float | None:
    return value / reference if value is not None and reference else None


def _step_samples(entry: dict, warmup: int) -> tuple[list[float], str]:
    """What the step-time spread is taken over: each repeat's median when the arm was repeated, else the
    steady (post-warm-up) steps of its single run."""
    medians = [r["median_step_time_s"] for r in entry.get("repeats") or [] if r.get("median_step_time_s") is not None]
    if medians:
        return medians, "per-repeat medians"
    return list(entry["step_time_s"][warmup:]), "steady steps"


def arm_stats(entry: dict, config: dict) -> dict:
    """The per-arm figures of the results table, each from its recorded key when present."""
    samples, sample_kind = _step_samples(entry, int(config.get("warmup_steps") or 0))
    recorded = entry.get("step_time_stats_s") or {}
    step_min = recorded.get("min", min(samples))
    if "median" in recorded:
        step_median = recorded["median"]
    elif sample_kind == "steady steps" and entry.get("median_step_time_s") is not None:
        step_median = entry["median_step_time_s"]  # the figure the recorded tokens_per_s was computed from
    else:
        step_median = statistics.median(samples)

    tps = entry.get("tokens_per_s_per_rank")
    repeat_tps = [r["tokens_per_s_per_rank"] for r in entry.get("repeats") or []
                  if r.get("tokens_per_s_per_rank") is not None]
    tokens, world = config.get("tokens_per_optimizer_step"), config.get("world_size") or config.get("nproc")
    if isinstance(tps, dict):
        tps_min, tps_median = tps.get("min"), tps.get("median")
    elif repeat_tps:
        tps_min, tps_median = min(repeat_tps), statistics.median(repeat_tps)
    elif tokens and world:
        # Each rank processes tokens/world per step; the slowest sample gives the minimum throughput.
        tps_min, tps_median = tokens / world / max(samples), tokens / world / step_median
    else:
        tps_min = tps_median = None
    return {
        "samples": samples, "sample_kind": sample_kind, "step_min": step_min, "step_median": step_median,
        "tps_min": tps_min, "tps_median": tps_median,
        "intra": entry["bytes_per_step"]["intra_node"], "inter": entry["bytes_per_step"]["inter_node"],
        "link": entry.get("link_bytes_inter_node_per_step"), "wire": entry.get("wire_bytes_inter_node_per_step"),
        **_comm_times(entry),
        "peak_rss": entry.get("peak_memory_bytes"), "model_state": (entry.get("model_state_bytes") or {}).get("total"),
    }


def _comm_times(entry: dict) -> dict:
    """Exposed and busy communication per step. Results that record busy time also record exposed time as the
    training thread's blocked time; older ones held the summed durations of the collective calls under the same
    key, which is kept apart ("in_collectives") rather than shown under a name it does not mean."""
    exposed, busy = entry.get("exposed_comm_s_per_step"), entry.get("comm_busy_s_per_step")
    if busy is None:
        return {"exposed": None, "busy": None, "in_collectives": exposed}
    return {"exposed": exposed, "busy": busy, "in_collectives": None}


def _ordered_ops(arms: dict) -> list[str]:
    ops = {op for entry in arms.values() for op in entry.get("bytes_per_step_by_op", {})}
    return [op for op in OP_ORDER if op in ops] + sorted(ops - set(OP_ORDER))


def _provenance(env: dict, config: dict) -> list[str]:
    def get(key):
        value = env.get(key)
        return NA + " (not recorded)" if value is None else f"`{value}`" if key == "git_commit" else str(value)

    network = config.get("network")
    if not network:
        net = "not recorded"
    elif network.get("mode") == "emulated":
        delay = network.get("inter_node_delay_ms")
        bw = network.get("inter_node_bw", NA)
        links = "inter-node links not shaped (unlimited)" if str(bw).lower() == "unlimited" else \
            f"inter-node links shaped to {bw}"
        net = (f"emulated nodes (network namespaces); {links}, "
               f"one-way delay {'none' if delay is None else f'{delay} ms'}, MTU {network.get('mtu', NA)}; "
               "ranks of one node talk over loopback, unshaped")
    else:
        net = f"{network.get('mode', NA)} (every rank talks over loopback; no shaping)"
    delay = config.get("comm_delay_ms")
    if delay:
        net += f"; plus {delay:g} ms injected before and after each of the package's own collectives (see Workload)"
    return ["## Provenance", "",
            f"- Date (UTC): {get('date')}",
            f"- Git commit: {get('git_commit')}",
            f"- Versions: torch {get('torch')}, deepspeed {get('deepspeed')}, ds_asynchzp {get('ds_asynchzp')}, "
            f"Python {get('python')}",
            f"- Host: {get('host_cpus')} CPUs; gloo on CPU ranks (no accelerator)",
            f"- Network: {net}", ""]


def _comm_delay_line(delay) -> str:
    if delay is None:
        return "- Injected communication delay: not recorded (runs that predate the option had none)"
    if not delay:
        return "- Injected communication delay: none (0 ms)"
    return (f"- Injected communication delay: {delay:g} ms before and after each of the package's own collectives, "
            "modelling link latency; it applies to the AsyncHZP arms only (stock DeepSpeed's collectives, which "
            "zero3 and hpz issue, are not delayed), so it is a handicap of the AsyncHZP arms against the stock ones "
            "and meant for comparing asynchzp with asynchzp-sync")


def _workload(results: dict) -> list[str]:
    config, arms = results["config"], results["arms"]
    world = config.get("world_size") or config.get("nproc")
    micro, seq, ga = config.get("micro_batch"), config.get("seq_len"), config.get("grad_accum")
    tokens = config.get("tokens_per_optimizer_step")
    params = config.get("model_parameters")
    experts = config.get("moe_experts") or 0
    lines = ["## Workload", "",
             f"- Model: `{config.get('model', NA)}` preset, "
             + (f"{experts} experts per block (MoE)" if experts else "dense MLP")
             + (f", {params:,} parameters" if isinstance(params, int) else ""),
             f"- Layout: {world} ranks = {config.get('num_nodes', NA)} simulated nodes x "
             f"{config.get('node_size', NA)} ranks per node",
             f"- Precision {config.get('dtype', NA)}; seed {config.get('seed', NA)}; AdamW lr {config.get('lr', NA)}, "
             f"weight decay {config.get('weight_decay', NA)}, gradient clipping {config.get('gradient_clipping', NA)}",
             f"- Batch: micro-batch {micro} sequences x seq-len {seq} tokens x grad accumulation {ga} micro-steps x "
             f"{world} ranks = **{_fmt(tokens, ',')} tokens per optimizer step, identical in every arm** (all arms "
             "ran from this one configuration and differ only in the overrides below)",
             f"- Steps: {config.get('steps', NA)} optimizer steps per arm; the first {config.get('warmup_steps', NA)} "
             "excluded from step-time and byte statistics as warm-up; repeats per arm: "
             + str(config.get("repeats") or "1 (no repeats recorded)"),
             _comm_delay_line(config.get("comm_delay_ms"))]
    if None not in (tokens, world, micro, seq, ga) and tokens != world * micro * seq * ga:
        lines.append(f"- **Warning:** tokens_per_optimizer_step {tokens} != ranks x micro-batch x seq-len x "
                     f"grad accumulation = {world * micro * seq * ga}")
    for arm, entry in arms.items():
        tps, median = entry.get("tokens_per_s"), entry.get("median_step_time_s")
        if tokens and tps and median and abs(tps * median - tokens) > CONSISTENCY_RTOL * tokens:
            lines.append(f"- **Warning:** arm {arm}: tokens_per_s x median step time = {tps * median:.1f}, "
                         f"not the {tokens} tokens per optimizer step of the configuration")
    knobs = config.get("zero_optimization") or {}
    preset = config.get("zero3_knobs") or "not recorded (before presets: no prefetch, no overlap)"
    lines += ["", f"ZeRO-3 settings shared by every arm (`--zero3-knobs {preset}`): "
              + (", ".join(f"`{k}={v}`" for k, v in knobs.items()) or "not recorded") + ".", "",
              CPU_OVERLAP_CAVEAT, "", "Arms:", ""]
    overrides = config.get("arm_overrides") or {}
    for arm, entry in arms.items():
        extra = overrides.get(arm)
        sizes, replicas = layout_cells(entry)
        layout = NA + " (not recorded)" if sizes == NA else f"d_p/d_g/d_o = {sizes} (replicas {replicas})"
        lines.append(f"- `{arm}`: optimizer `{entry.get('optimizer_class', NA)}`; layout {layout}; overrides: "
                     + (", ".join(f"`{k}={json.dumps(v)}`" for k, v in extra.items()) if extra else "none"))
    return lines + [""]


def _layout(arms: dict) -> list[str]:
    rows, texts = [], []
    for arm, entry in arms.items():
        layout = entry.get("layout") or {}
        sizes, replicas = layout_cells(entry)
        nodes, per_node = layout.get("num_nodes"), layout.get("node_size")
        rows.append([arm, *(sizes.split("/") if sizes != NA else [NA] * 3),
                     *(replicas.split("/") if replicas != NA else [NA] * 3),
                     NA if nodes is None or per_node is None else f"{nodes} x {per_node}"])
        described = [t for t in (entry.get("layout_text"),
                                 layout.get("auto_reason") and f"\"auto\": {layout['auto_reason']}") if t]
        if described:
            texts.append(f"- `{arm}`: " + "; ".join(described))
    return ["## Layout", "",
            *markdown_table([["arm", "d_p", "d_g", "d_o", "param replicas", "grad replicas", "optimizer replicas",
                             "nodes x ranks"], *rows]), "", *texts, *([""] if texts else []),
            LAYOUT_LEGEND + " n/a: the run did not record a layout.", ""]


def _results_table(arms: dict, stats: dict, config: dict) -> list[str]:
    ref = stats.get(REFERENCE_ARM)
    columns = [("arm", lambda a, s: a),
               ("tokens/s/rank min", lambda a, s: _fmt(s["tps_min"], ".1f")),
               ("tokens/s/rank median", lambda a, s: _fmt(s["tps_median"], ".1f")),
               ("step s min", lambda a, s: _fmt(s["step_min"], ".3f")),
               ("step s median", lambda a, s: _fmt(s["step_median"], ".3f")),
               ("speed-up vs zero3", lambda a, s: _fmt(ref and _ratio(ref["step_median"], s["step_median"]), ".3f")),
               ("intra MB/step", lambda a, s: _mb(s["intra"])),
               ("inter MB/step", lambda a, s: _mb(s["inter"])),
               ("inter ratio vs zero3", lambda a, s: _fmt(ref and _ratio(s["inter"], ref["inter"]), ".3f"))]
    # Optional measurements get a column only when some arm has them, so loopback runs carry no empty columns.
    seconds = lambda v: _fmt(v, ".3f")  # noqa: E731
    optional = [("wire", "link MB/step (counted)", _mb), ("link", "link MB/step (model)", _mb),
                ("exposed", "exposed comm s/step", seconds), ("busy", "comm busy s/step", seconds),
                ("in_collectives", "in collectives s/step (older results)", seconds)]
    for key, title, fmt in optional:
        if any(s[key] is not None for s in stats.values()):
            columns.append((title, lambda a, s, key=key, fmt=fmt: fmt(s[key])))
            if key == "wire":   # the counted ratio right after the counted bytes
                columns.append(("counted link ratio vs zero3",
                                lambda a, s: _fmt(_ratio(s["wire"], ref and ref["wire"]), ".3f")))
    host = shows_host_overhead({"config": config})
    if host:
        columns += [(title, lambda a, s, i=i: host_cells(arms[a], arms.get(REFERENCE_ARM))[i])
                    for i, title in enumerate(HOST_COLUMNS)]
    columns += [("peak RSS MB", lambda a, s: _fmt(s["peak_rss"] and s["peak_rss"] / MB, ".1f")),
                ("model-state MB", lambda a, s: _mb(s["model_state"]))]
    rows = [[fn(arm, stats[arm]) for _, fn in columns] for arm in arms]
    kinds = sorted({s["sample_kind"] for s in stats.values()})
    return ["## Results", "", *markdown_table([[c[0] for c in columns], *rows]), "",
            f"Step time: slowest rank per step; min and median over {' / '.join(kinds)} (or the recorded "
            "`step_time_stats_s`). Tokens/s per rank: recorded, or tokens per step / ranks / step time (its min comes "
            "from the slowest sample). Speed-up: zero3 median step time / the arm's. Bytes: ring-model bytes sent per "
            "rank per optimizer step, steady-state mean over ranks; MB = 10^6 bytes. Link MB (counted): bytes counted "
            "on the emulated node links (headers included), per rank, with its ratio to zero3's; link MB (model): "
            "the ledger's prediction of the payload crossing them (gloo's rings on the run's links). "
            + COMM_FOOTNOTE + (DELAY_FOOTNOTE if config.get("comm_delay_ms") else "")
            + (IN_COLLECTIVES_FOOTNOTE if any(s["in_collectives"] is not None for s in stats.values()) else "")
            + "Peak RSS: largest rank. Model-state: rank 0."
            + (" " + host_legend(arms) if host else ""), ""]


COMM_FOOTNOTE = (
    "Exposed comm: time the training thread was blocked on communication (inside a synchronous collective, in the "
    "wait() of an asynchronous one, or waiting on a communication thread's job). Comm busy: time any collective "
    "was in flight, issue to completion, on any thread (the union of their intervals). Both are taken per "
    "optimizer step as the maximum over ranks, since the slowest rank bounds the step, then the median over "
    "steady steps. Communication overlapped with compute shows as busy >> exposed; busy ~ exposed means the "
    "training thread waited for all of it. ")
DELAY_FOOTNOTE = (
    "The injected delays count as communication: as busy time on every thread, and as exposed time where the "
    "training thread sleeps or waits on a job that does. ")
IN_COLLECTIVES_FOOTNOTE = (
    "In collectives (older results): the summed durations of the collective calls, mean over ranks, which results "
    "written before exposed and busy time were recorded hold; it is neither of them. ")


def _bytes_table(arms: dict) -> list[str]:
    rows, skipped = [], []
    for arm, entry in arms.items():
        by_op = entry.get("bytes_per_step_by_op", {})
        for op in _ordered_ops({arm: entry}):
            intra, inter = by_op[op].get("intra_node", 0.0), by_op[op].get("inter_node", 0.0)
            if intra or inter:
                rows.append([arm, op, _mb(intra), _mb(inter)])
            else:
                skipped.append(f"{arm}/{op}")
    calls = ", ".join(f"{arm} {_fmt(e.get('collective_calls_per_step'), '.1f')}" for arm, e in arms.items())
    return ["## Bytes per collective kind", "",
            *markdown_table([["arm", "collective", "intra MB/step", "inter MB/step"], *rows], text_columns=2), "",
            f"Collectives with no bytes in this run: {', '.join(skipped) or 'none'} (point-to-point bytes are counted "
            f"by the sender, so `recv` is always 0). Collective calls per optimizer step: {calls}.", ""]


def _offload(results: dict) -> list[str]:
    """The offload arms' host memory and host<->device copies (`bench/offload.py`) and their step boundary
    (`bench/boundary_table.py`), where the run had any."""
    from .boundary_table import format_boundary_table
    from .offload import format_offload_table

    return format_offload_table(results) + format_boundary_table(results)


def _volume(results: dict) -> list[str]:
    """ZeRO++'s volume table, where the run recorded flows and the planner has formulas for it (dense models)."""
    from .volume_table import format_measured_flow_table, format_volume_table

    if is_job_run(results):
        return format_measured_flow_table(results)
    try:
        return format_volume_table(results)
    except (ValueError, KeyError) as exc:  # an MoE run, or results without what the formulas need
        return ["## Cross-node volume by flow", "", f"Not tabulated: {exc}.", ""]


def _parity(arms: dict) -> list[str]:
    ref = arms.get(REFERENCE_ARM)
    rows = []
    for arm, entry in arms.items():
        losses = entry["losses"]
        if ref is None:
            rel = absolute = same = NA
        else:
            pairs = list(zip(losses, ref["losses"]))
            rel = f"{max_rel_loss_diff(losses, ref['losses']):.2e}"
            absolute = f"{max(abs(a - b) for a, b in pairs):.2e}"
            same = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        rows.append([arm, f"{losses[-1]:.9f}", rel, absolute, same])
    return ["## Loss parity", "",
            *markdown_table([["arm", "final loss", "max |rel diff| vs zero3", "max |abs diff| vs zero3",
                             "steps bit-identical to zero3"], *rows]), "",
            "Losses are the mean over ranks of each optimizer step's loss, with the same weights, data and seed in "
            "every arm." + ("" if ref else " No zero3 arm was run, so there is no reference."), ""]


def _memory(arms: dict) -> list[str]:
    roles = memory_roles(arms)
    rows = [[arm] + [_mb(role_bytes(e, r)) for r in roles] + [_mb((e.get("model_state_bytes") or {}).get("total"))]
            for arm, e in arms.items()]
    return ["## Model-state memory (rank 0, MB)", "", *markdown_table([["arm", *roles, "total"], *rows]), "",
            "Bytes of the tensors holding each role on rank 0, each storage counted once "
            "(`ds_asynchzp.measure.memory.model_state_bytes`); every role any arm has gets a column, 0 where an "
            "arm has none. param_primary / param_secondary / grad_primary: stock ZeRO-3 and hpZ partitions; "
            "param_shard / grad_shard: AsyncHZP's intra-node shards; master and optimizer_state: fp32 master weights "
            "and Adam moments (with optimizer offload on the host, with stock's grad_primary: see the offload "
            "section).", ""]


HOW_TO_READ = """## How to read this

- **Bytes** are what the communication ledger records for every collective the engine issues: under the ring
  model one rank sends (n-1)/n x S for an all-gather or reduce-scatter of total size S over n ranks, 2(n-1)/n x S
  for an all-reduce, and S for a point-to-point send. A collective is counted as inter-node when its group spans
  more than one node, so for a world-wide collective all of its ring bytes count as inter-node, including hops
  that stay inside a node; the link/wire columns (when present) give the bytes that actually crossed node links.
- **Times** come from {ranks} CPU rank processes sharing {cpus} cores, talking through gloo. Absolute step times
  are not GPU times and should not be compared with them; compare the ratios between arms, which were measured
  side by side on the same host with the same workload.
- **Loss parity**: the arms change only where tensors live and which group reduces them, so losses should agree
  up to the rounding of a different summation order (fp32 unit roundoff is about 6e-8), or exactly.
- **Peak RSS** includes each process's Python and torch runtime; the differences between arms are what matter.
"""


TIMELINE_GUIDE = (
    "The timeline shows one steady optimizer step of rank 0 per arm: the training thread's compute with its waits "
    "on communication in red, and every collective on the lane of the thread that issued it. Look at the red: "
    "with communication on the background threads (asynchzp) the bars move to the asynchzp-gather / -reduce / "
    "-boundary lanes and run under compute, so the red stays short; with synchronous communication (asynchzp-sync, "
    "zero3, hpz) each collective sits on the training thread's lane above a matching red wait.")


# ------------------------------------------------------------------------------------------------- plots
def _new_figure(rows: int, cols: int, size: tuple[float, float], **kwargs):
    # A bare Figure on the Agg canvas: no pyplot, so no global state and no display is ever touched.
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("the benchmark report needs matplotlib: pip install 'ds-asynchzp[bench]'") from exc
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False, **kwargs)


def _style(arm: str, arms) -> tuple[str, str, float]:
    """Fixed styles for the stock arm names; the other arms take distinct colours in their order of appearance."""
    if arm in ARM_STYLES:
        return ARM_STYLES[arm]
    others = [a for a in arms if a not in ARM_STYLES]
    return EXTRA_COLORS[others.index(arm) % len(EXTRA_COLORS)], "-.", 2.0


def _arm_ticks(ax, names: list[str]) -> None:
    # Spec names (asynchzp:param_shard_size=1) are long: slant them so neighbours do not overlap.
    if any(len(n) > 12 for n in names):
        ax.tick_params(axis="x", labelrotation=20)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")


def _plot_loss(arms: dict, path: Path) -> None:
    fig, axes = _new_figure(2, 1, (8, 7), sharex=True)
    ax_loss, ax_diff = axes[0, 0], axes[1, 0]
    ref = arms.get(REFERENCE_ARM)
    for arm, entry in arms.items():
        color, dash, width = _style(arm, arms)
        steps = range(1, len(entry["losses"]) + 1)
        ax_loss.plot(steps, entry["losses"], dash, color=color, linewidth=width, marker="o", markersize=4, label=arm)
        if ref is None or arm == REFERENCE_ARM:
            continue
        diffs = [(s, abs(a - b) / abs(b) if b else abs(a - b))
                 for s, a, b in zip(steps, entry["losses"], ref["losses"])]
        drawn = [(s, d) for s, d in diffs if d > 0]  # zero has no place on a log axis; counted in the label
        label = f"{arm} ({len(diffs) - len(drawn)}/{len(diffs)} steps identical, not drawn)"
        ax_diff.plot([s for s, _ in drawn], [d for _, d in drawn], dash, color=color, marker="o", label=label)
    ax_loss.set(title="Training loss per optimizer step (mean over ranks; identical curves overlap)", ylabel="loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_diff.set_yscale("log")
    ax_diff.set(title="|loss - zero3 loss| / zero3 loss", xlabel="optimizer step", ylabel="relative difference")
    if ref is None:
        ax_diff.text(0.5, 0.5, "no zero3 arm in this run", ha="center", transform=ax_diff.transAxes)
    elif len(arms) > 1:
        ax_diff.legend()
    positive = [d for line in ax_diff.get_lines() for d in line.get_ydata()]
    if positive:
        # Whole decades, so the size of a difference reads off the axis even when all points sit in one decade.
        ax_diff.set_ylim(10 ** math.floor(math.log10(min(positive))), 10 ** math.ceil(math.log10(max(positive))))
    ax_diff.grid(alpha=0.3, which="both")
    ax_diff.xaxis.get_major_locator().set_params(integer=True)
    fig.savefig(path, dpi=110)


def _plot_bytes(arms: dict, stats: dict, path: Path) -> None:
    fig, axes = _new_figure(1, 2, (11, 5), sharey=True)
    names, ops = list(arms), _ordered_ops(arms)
    for ax, where, title in ((axes[0, 0], "intra_node", "intra-node"), (axes[0, 1], "inter_node", "inter-node")):
        bottoms = [0.0] * len(names)
        for k, op in enumerate(ops):
            heights = [arms[a].get("bytes_per_step_by_op", {}).get(op, {}).get(where, 0.0) / MB for a in names]
            if any(heights):
                ax.bar(names, heights, bottom=bottoms, color=f"C{k}", label=op)
                bottoms = [b + h for b, h in zip(bottoms, heights)]
        for x, arm in enumerate(names):
            ax.annotate(f"{stats[arm]['intra' if where == 'intra_node' else 'inter'] / MB:.2f}", (x, bottoms[x]),
                        ha="center", va="bottom", xytext=(0, 2), textcoords="offset points")
        if where == "inter_node":
            # Side by side, so a measurement that matches its prediction does not hide it.
            for key, dx, style, label in (("link", -0.15, {"marker": "D", "facecolors": "none", "edgecolors": "black"},
                                           "ledger: bytes crossing node links"),
                                          ("wire", 0.15, {"marker": "*", "color": "red"},
                                           "measured on emulated links")):
                points = [(x + dx, stats[a][key] / MB) for x, a in enumerate(names) if stats[a][key] is not None]
                if points:
                    ax.scatter(*zip(*points), s=80, zorder=3, label=label, **style)
        ax.set(title=f"{title} (ring model, per rank)", xlabel="arm")
        _arm_ticks(ax, names)
        ax.grid(axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a side with no bytes at all has nothing to label
            ax.legend(fontsize="small")
    tallest = max(max(s["intra"], s["inter"], s["link"] or 0, s["wire"] or 0) for s in stats.values()) / MB
    axes[0, 0].set_ylim(0, tallest * 1.12 or 1.0)  # room for the totals above the tallest bar
    axes[0, 0].set_ylabel("MB sent per optimizer step (10^6 bytes)")
    fig.suptitle("Bytes per optimizer step by collective kind (steady-state mean over ranks)")
    fig.savefig(path, dpi=110)


def _plot_step_time(arms: dict, stats: dict, path: Path) -> None:
    fig, axes = _new_figure(1, 1, (8, 5))
    ax, names = axes[0, 0], list(arms)
    ref = stats.get(REFERENCE_ARM)
    medians = [stats[a]["step_median"] for a in names]
    ax.bar(names, medians, color=[_style(a, names)[0] for a in names], alpha=0.75, label="median")
    # The training thread's blocked time where recorded; older results only hold time inside collectives.
    key, what = (("exposed", "of which training thread blocked on communication (median)")
                 if any(stats[a]["exposed"] is not None for a in names)
                 else ("in_collectives", "of which in collectives (median)"))
    exposed = [stats[a][key] for a in names]
    if any(e is not None for e in exposed):
        ax.bar(names, [e or 0.0 for e in exposed], fill=False, hatch="//", edgecolor="black", label=what)
    busy = [(x, stats[a]["busy"]) for x, a in enumerate(names) if stats[a]["busy"] is not None]
    if busy:
        ax.hlines([b for _, b in busy], [x - 0.4 for x, _ in busy], [x + 0.4 for x, _ in busy], color="black",
                  linestyles=":", linewidth=2, zorder=4, label="communication in flight, any thread (median)")
    for x, arm in enumerate(names):
        samples = stats[arm]["samples"]
        # Fixed horizontal spread instead of random jitter, so the same file gives the same picture.
        offsets = [0.0] if len(samples) == 1 else [-0.25 + 0.5 * i / (len(samples) - 1) for i in range(len(samples))]
        ax.scatter([x + o for o in offsets], samples, s=12, color="black", zorder=3,
                   label=stats[arm]["sample_kind"] if x == 0 else None)
        ax.hlines(stats[arm]["step_min"], x - 0.4, x + 0.4, color="red", linestyles="--", zorder=4,
                  label="min" if x == 0 else None)
        speedup = ref and _ratio(ref["step_median"], stats[arm]["step_median"])
        # Inside the bar above the hatched part, where no sample point or hatch can cover it.
        floor = min(exposed[x] or 0.0, medians[x])
        label = f"median\n{medians[x]:.3f} s" + (f"\n{speedup:.2f}x vs zero3" if speedup else "")
        ax.text(x, (floor + medians[x]) / 2, label,
                ha="center", va="center", bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none"})
    ax.set(title="Time per optimizer step (slowest rank)", xlabel="arm", ylabel="seconds per optimizer step")
    _arm_ticks(ax, names)
    ax.set_ylim(0, max(max(s["samples"]) for s in stats.values()) * 1.3)  # headroom for the legend
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", loc="upper center", ncols=4)
    fig.savefig(path, dpi=110)


# -------------------------------------------------------------------------------------------------- entry
def write_report(results: dict, out_dir: Path) -> Path:
    """Write ``out_dir/report.md`` and its plots for one results.json structure; returns the report's path."""
    arms, config, env = results.get("arms") or {}, results.get("config") or {}, results.get("env") or {}
    if not arms:
        raise ValueError("results hold no arm to report on")
    results = dict(results, config=config, env=env)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stats = {arm: arm_stats(entry, config) for arm, entry in arms.items()}
    _plot_loss(arms, out_dir / "loss.png")
    _plot_bytes(arms, stats, out_dir / "bytes.png")
    _plot_step_time(arms, stats, out_dir / "step_time.png")
    timeline_notes = plot_timelines(arms, out_dir / "timeline.png")
    job = is_job_run(results)
    title = (f"# asynchzp-ab A/B report: {', '.join(arms)} on `{config.get('command', NA)}`" if job else
             f"# asynchzp-bench A/B report: {', '.join(arms)} on `{config.get('model', NA)}`, "
             f"{config.get('world_size') or config.get('nproc', NA)} CPU ranks")
    unavailable = [f"- **{arm}** was not run: {why}." for arm, why in (results.get("unavailable_arms") or {}).items()]
    described = ([*job_provenance(results), *job_workload(results), CPU_OVERLAP_CAVEAT, ""] if job else
                 [*_provenance(env, config), *_workload(results)])
    lines = [title, "", *opening(results, stats), *described, *(unavailable + [""] if unavailable else []),
             *_results_table(arms, stats, config), *format_link_table(arms, config),
             *_bytes_table(arms), *format_model_table(arms), *_volume(results), *_offload(results), *_parity(arms), *_layout(arms),
             *_memory(arms), *format_buffer_table(arms), "## Plots", "",
             "![loss per optimizer step and relative difference vs zero3](loss.png)", "",
             "![bytes per optimizer step by collective kind](bytes.png)", "",
             "![time per optimizer step](step_time.png)", "",
             "![one optimizer step of rank 0, interval by interval](timeline.png)", "",
             TIMELINE_GUIDE, *(["", "Left out of the timeline: " + "; ".join(timeline_notes) + "."]
                               if timeline_notes else []), "",
             HOW_TO_READ.format(ranks=config.get("nproc", NA), cpus=env.get("host_cpus", NA))]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines).rstrip("\n") + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ds_asynchzp.bench.report",
        description="Regenerate report.md and its plots from an asynchzp-bench results.json.")
    parser.add_argument("results", type=Path, help="results.json written by asynchzp-bench (or its archived .gz)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: next to RESULTS)")
    args = parser.parse_args(argv)
    try:
        results = read_results(args.results)
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"cannot read {args.results}: {exc}")
    path = write_report(results, args.out or args.results.parent)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
