"""Collapse per-rank measurements of one arm (and its repeats) into a results.json entry.

Conventions, stated once:
* bytes are per rank per optimizer step: the steady-state mean of each rank (steps after `--warmup-steps`),
  then the mean over ranks;
* a step is as slow as its slowest rank (the others wait for it in the next collective);
* so is its communication: exposed and busy communication time per step are the maximum over ranks, since the
  slowest rank bounds the step, then the median over steady steps;
* wire bytes of an emulated cluster are the node links' transmit counters summed over nodes, per step, divided
  by the number of ranks, so they compare with the ledger's per-rank figures.
"""

from __future__ import annotations

import statistics

from ..platform.ledger import BOUNDARY_PHASES


def _steady_mean(values: list, warmup: int) -> float:
    steady = values[warmup:]
    return sum(steady) / len(steady)


def _per_step_max(by_rank: list, key: str, n_steps: int) -> list | None:
    """Per step, the largest `key` over ranks; None when a rank did not record it (workers predating the key)."""
    if any(key not in st for r in by_rank for st in r["steps"]):
        return None
    return [max(r["steps"][s][key] for r in by_rank) for s in range(n_steps)]


def _steady_median(values: list | None, warmup: int) -> float | None:
    return None if values is None else statistics.median(values[warmup:])


def _boundary_per_step(by_rank: list, n_steps: int, extract) -> list | None:
    """Per step, the largest boundary figure over ranks (`measure.boundary`); None where a step has none (stock
    arms without offload, older workers) or the figure is None."""
    values = []
    for s in range(n_steps):
        found = [extract(r["steps"][s].get("boundary")) if r["steps"][s].get("boundary") else None for r in by_rank]
        if any(v is None for v in found):
            return None
        values.append(max(found))
    return values


def boundary_figures(by_rank: list, n_steps: int, warmup: int) -> dict:
    """The offload boundary's figures of one repeat: per steady step the slowest rank's, then the median (the
    boundary is as slow as its slowest rank, as the step is)."""
    wall = _boundary_per_step(by_rank, n_steps, lambda b: b["wall_s"])
    critical = _boundary_per_step(by_rank, n_steps, lambda b: b["critical_path_s"])
    phases = {kind: _steady_median(_boundary_per_step(by_rank, n_steps, lambda b, k=kind: b["phase_s"][k]), warmup)
              for kind in BOUNDARY_PHASES} if wall is not None else None
    # After the exchange: the window less the sums' busy time in it (they run first, back to back on the boundary
    # thread), what the host step, the copies and the step's own work take once the gradients are summed.
    after = _boundary_per_step(by_rank, n_steps, lambda b: b["wall_s"] - b["phase_s"]["sum"])
    after_critical = _boundary_per_step(by_rank, n_steps, lambda b: None if b["critical_path_s"] is None
                                        else b["critical_path_s"] - b["phase_s"]["sum"])
    return {"boundary_wall_s": _steady_median(wall, warmup),
            "boundary_critical_path_s": _steady_median(critical, warmup),
            "boundary_after_exchange_s": _steady_median(after, warmup),
            "boundary_after_exchange_critical_path_s": _steady_median(after_critical, warmup),
            "boundary_phase_s": phases,
            "boundary_other_s": _steady_median(_boundary_per_step(by_rank, n_steps, lambda b: b["other_s"]), warmup),
            "boundary_chunks": (by_rank[0]["steps"][0].get("boundary") or {}).get("chunks")}


def host_us_per_param(step_time_s: float, parameter_tensors: int | None) -> float | None:
    """Microseconds of step time per parameter tensor: on a model of many tiny tensors (the host-overhead preset)
    the step is the per-parameter host work of fetching, releasing and reducing, so this is that work per
    parameter per optimizer step. None when the worker did not count its tensors."""
    if not parameter_tensors:
        return None
    return step_time_s * 1e6 / parameter_tensors


def _device_peaks(by_rank: list) -> dict | None:
    peaks = [r.get("device_memory_peak_bytes") for r in by_rank]
    if any(p is None for p in peaks):
        return None
    return {kind: max(p[kind] for p in peaks) for kind in ("allocated", "reserved")}


def aggregate_arm(rank_results: list, warmup: int, tokens_per_step: int) -> dict:
    """One repeat of one arm."""
    n_ranks = len(rank_results)
    by_rank = sorted(rank_results, key=lambda r: r["rank"])
    n_steps = len(by_rank[0]["steps"])
    losses = [sum(r["steps"][s]["loss"] for r in by_rank) / n_ranks for s in range(n_steps)]
    step_times = [max(r["steps"][s]["time_s"] for r in by_rank) for s in range(n_steps)]

    def mean_over_ranks(extract) -> float:
        return sum(_steady_mean([extract(step) for step in r["steps"]], warmup) for r in by_rank) / n_ranks

    where = ("intra_node", "inter_node")
    bytes_per_step = {w: mean_over_ranks(lambda st, w=w: st[w]) for w in where}
    bytes_by_family = bytes_by_flow = host_device = None
    ops = sorted({op for r in by_rank for st in r["steps"] for op in st["by_op"]})
    bytes_by_op = {op: {w: mean_over_ranks(lambda st, op=op, w=w: st["by_op"].get(op, {}).get(w, 0.0))
                        for w in where} for op in ops}
    # Summed durations of the collective calls, mean over ranks. With communication threads an asynchronous call
    # returns at once and several may run at a time, so this compares neither between arms nor with step time;
    # exposed and busy time below do.
    comm_time = [sum(r["steps"][s]["comm_s"] for r in by_rank) / n_ranks for s in range(n_steps)]
    exposed = _per_step_max(by_rank, "exposed_comm_s", n_steps)
    cpu = _per_step_max(by_rank, "cpu_s", n_steps)
    busy = _per_step_max(by_rank, "comm_busy_s", n_steps)

    # Link counters: one reader per link (local rank 0 of a node on one link per node, every rank on rails), so
    # summing readers counts each link once.
    readers = [r for r in by_rank if r["steps"][0].get("node_tx_bytes") is not None]
    wire = by_link = packets_by_link = crossing = None
    if readers:
        wire = sum(_steady_mean([st["node_tx_bytes"] for st in r["steps"]], warmup) for r in readers) / n_ranks
    link = mean_over_ranks(lambda st: st["link_bytes"])
    if all("steady_bytes_per_step" in r for r in by_rank):
        # Totals over all steady steps, from and to a quiet point: per-step windows split a refresh that runs
        # into the next step by timing (the per-step figures above stay in `steps` for plots only).
        steady = [r["steady_bytes_per_step"] for r in by_rank]
        bytes_per_step = {w: sum(s[w] for s in steady) / n_ranks for w in where}
        ops = sorted({op for s in steady for op in s["by_op"]})
        bytes_by_op = {op: {w: sum(s["by_op"].get(op, {}).get(w, 0.0) for s in steady) / n_ranks for w in where}
                       for op in ops}
        link = sum(s["link_bytes"] for s in steady) / n_ranks
        families = sorted({f for s in steady for f in s.get("by_family", {})})
        bytes_by_family = {f: {w: sum(s.get("by_family", {}).get(f, {}).get(w, 0.0) for s in steady) / n_ranks
                               for w in where} for f in families}
        flows = sorted({f for s in steady for f in s.get("by_flow", {})})
        # Each flow's bytes, and the part of them that is quantization scales.
        flow_keys = (*where, *(w + "_scales" for w in where))
        bytes_by_flow = {f: {w: sum(s.get("by_flow", {}).get(f, {}).get(w, 0.0) for s in steady) / n_ranks
                             for w in flow_keys} for f in flows}
        if readers:
            wire = sum(r["steady_bytes_per_step"]["node_tx_bytes"] for r in readers) / n_ranks
            by_link = {r["link"]: r["steady_bytes_per_step"]["node_tx_bytes"] for r in readers if r.get("link")}
            # Frames per link, where the recorder read them (older records did not): their headers come off.
            packets_by_link = {r["link"]: r["steady_bytes_per_step"]["node_tx_packets"] for r in readers
                               if r.get("link") and r["steady_bytes_per_step"].get("node_tx_packets") is not None}
            packets_by_link = packets_by_link if len(packets_by_link) == len(by_link) else None
        if all("crossing_messages" in s for s in steady):
            # Every rank's messages to ranks of other nodes, keyed "src>dst": the library's control bytes per
            # message ride on the links they cross (`bench.plan_check`).
            crossing = {style: {f"{r['rank']}>{peer}": count
                                for r, s in zip(by_rank, steady) for peer, count in s["crossing_messages"][style].items()}
                        for style in ("ring", "pairwise")}
        if all("host_device" in s for s in steady):
            host_device = {d: sum(s["host_device"][d] for s in steady) / n_ranks for d in ("to_host", "to_device")}
            host_device["total"] = host_device["to_host"] + host_device["to_device"]

    models = sorted({m for r in by_rank for st in r["steps"] for m in st.get("by_model", {})})
    model_keys = (*where, "link_bytes")
    # Per labelled model (an engine without an optimizer: a reference model), every step's bytes, mean over ranks,
    # and the steady steps' (the first step may differ: a copy made at its first gather).
    bytes_by_model_by_step = {m: [{k: sum(r["steps"][s].get("by_model", {}).get(m, {}).get(k, 0.0) for r in by_rank)
                                   / n_ranks for k in model_keys} for s in range(n_steps)] for m in models} or None
    bytes_by_model = None
    if models and all("by_model" in r.get("steady_bytes_per_step", {}) for r in by_rank):
        bytes_by_model = {m: {k: sum(r["steady_bytes_per_step"]["by_model"].get(m, {}).get(k, 0.0) for r in by_rank)
                              / n_ranks for k in model_keys} for m in models}
    median_step = statistics.median(step_times[warmup:])
    tensors = by_rank[0].get("parameter_tensors")
    cpu_median = _steady_median(cpu, warmup)
    classes = sorted({r["optimizer_class"] for r in by_rank})
    return {
        "losses": losses,
        "step_time_s": step_times,
        "median_step_time_s": median_step,
        "parameter_tensors": tensors,
        "host_us_per_param_per_step": host_us_per_param(median_step, tensors),
        # Process CPU time per step (all threads of a rank), slowest rank, median over steady steps; per parameter.
        "cpu_s": cpu,
        "cpu_s_per_step": cpu_median,
        "host_cpu_us_per_param_per_step": None if cpu_median is None else host_us_per_param(cpu_median, tensors),
        "startup_s": {k: max(r["startup_s"][k] for r in by_rank) for k in by_rank[0]["startup_s"]},
        "bytes_per_step": bytes_per_step,
        "bytes_per_step_by_op": bytes_by_op,
        # dense / expert / tokens (AutoEP's experts and token all-to-all; dense alone without AutoEP).
        "bytes_per_step_by_family": bytes_by_family,
        # forward gather / backward gather / gradient reduction / parameter refresh / other (formulas.flows).
        "bytes_per_step_by_flow": bytes_by_flow,
        # A labelled model's share (`platform.ledger.model_scope`: the forwards of an engine without an optimizer),
        # steady and step by step; None when the job ran none.
        "bytes_per_step_by_model": bytes_by_model,
        "bytes_by_model_by_step": bytes_by_model_by_step,
        "families": by_rank[0].get("families"),
        # Bytes copied between device and host memory that the ledger saw (AsyncHZP's offload copies), per rank per
        # optimizer step, mean over ranks; None from workers that predate the figure.
        "host_device_bytes_per_step": host_device,
        "link_bytes_inter_node_per_step": link,
        "wire_bytes_inter_node_per_step": wire,
        # Per link ("node<i>/eth<k>"), counted on the link, per optimizer step (frame headers included).
        "wire_bytes_by_link_per_step": by_link,
        "wire_packets_by_link_per_step": packets_by_link,
        "crossing_messages_per_step": crossing,
        "comm_time_s": comm_time,
        # Per optimizer step, slowest rank: training thread blocked on communication / any collective in flight.
        "exposed_comm_s": exposed,
        "comm_busy_s": busy,
        # Under optimizer offload: the step boundary (`measure.boundary`), slowest rank, median over steady steps.
        **boundary_figures(by_rank, n_steps, warmup),
        "exposed_comm_s_per_step": _steady_median(exposed, warmup),
        "comm_busy_s_per_step": _steady_median(busy, warmup),
        "collective_calls_per_step": mean_over_ranks(lambda st: st["calls"]),
        "peak_memory_bytes": max(r["peak_rss_bytes"] for r in by_rank),
        # On CUDA ranks, the caching allocator's peaks (largest rank); None on CPU ranks and older records.
        "device_memory_peak_bytes": _device_peaks(by_rank),
        "model_state_bytes": by_rank[0]["model_state_bytes"],
        # Under optimizer offload, rank 0's model states on the host by role (`bench.offload`).
        "host_state_bytes": by_rank[0].get("host_state_bytes"),
        "host_optimizer_class": by_rank[0].get("host_optimizer_class"),
        # The resolved group sizes (the same on every rank; rank 0's), and their one-line description.
        "layout": by_rank[0].get("layout"),
        "layout_text": by_rank[0].get("layout_text"),
        "optimizer_class": classes[0] if len(classes) == 1 else ",".join(classes),
        # One step of rank 0 drawn interval by interval (the report's timeline plot); None from workers without it.
        "timeline": by_rank[0].get("timeline"),
        "timeline_step": by_rank[0].get("timeline_step"),
        "timeline_rank": by_rank[0]["rank"],
        "buffer_allocations": by_rank[0].get("buffer_allocations"),
        # AsyncHZP's own buffers beyond model states, by kind: rank 0's, and each rank's total (they differ where
        # ranks hold different shares, e.g. AutoEP's experts); None for stock arms and older workers.
        "package_buffer_bytes": by_rank[0].get("package_buffer_bytes"),
        "package_buffer_bytes_total_by_rank": (None if any(r.get("package_buffer_bytes") is None for r in by_rank)
                                               else [r["package_buffer_bytes"]["total"] for r in by_rank]),
        "staging_rings": by_rank[0].get("staging_rings"),
        # Whole job (all ranks); the per-rank figure is below.
        # None where the tool does not know the tokens of a step (asynchzp-ab on the user's job).
        "tokens_per_s": tokens_per_step / median_step if tokens_per_step and median_step > 0 else None,
        "tokens_per_s_per_rank_this_repeat": (tokens_per_step / n_ranks / median_step
                                              if tokens_per_step and median_step > 0 else None),
        "per_rank": [{
            "rank": r["rank"],
            "losses": [st["loss"] for st in r["steps"]],
            "step_time_s": [st["time_s"] for st in r["steps"]],
            "intra_node_bytes": [st["intra_node"] for st in r["steps"]],
            "inter_node_bytes": [st["inter_node"] for st in r["steps"]],
            "peak_rss_bytes": r["peak_rss_bytes"],
            "model_state_bytes_total": r["model_state_bytes"].get("total"),
        } for r in by_rank],
    }


def merge_repeats(entries: list) -> dict:
    """The first repeat's entry (losses and bytes are deterministic; its timeline and buffer allocations), plus
    min/median over repeats of the timings.

    `tokens_per_s_per_rank` and `step_time_stats_s` are taken over the repeats' medians of steady-state steps.
    """
    merged = dict(entries[0])
    merged.pop("tokens_per_s_per_rank_this_repeat", None)
    merged["repeats"] = [{
        "step_time_s": e["step_time_s"],
        "median_step_time_s": e["median_step_time_s"],
        "tokens_per_s_per_rank": e["tokens_per_s_per_rank_this_repeat"],
        "wire_bytes_inter_node_per_step": e["wire_bytes_inter_node_per_step"],
        "comm_time_s": e["comm_time_s"],
        "exposed_comm_s": e.get("exposed_comm_s"),
        "comm_busy_s": e.get("comm_busy_s"),
        "exposed_comm_s_per_step": e.get("exposed_comm_s_per_step"),
        "comm_busy_s_per_step": e.get("comm_busy_s_per_step"),
        "cpu_s_per_step": e.get("cpu_s_per_step"),
        "boundary_wall_s": e.get("boundary_wall_s"),
        "boundary_critical_path_s": e.get("boundary_critical_path_s"),
        "boundary_after_exchange_s": e.get("boundary_after_exchange_s"),
        "boundary_after_exchange_critical_path_s": e.get("boundary_after_exchange_critical_path_s"),
        "losses_identical_to_first": e["losses"] == entries[0]["losses"],
    } for e in entries]
    medians = [e["median_step_time_s"] for e in entries]
    per_rank = [e["tokens_per_s_per_rank_this_repeat"] for e in entries]
    merged["step_time_stats_s"] = {"min": min(medians), "median": statistics.median(medians)}
    per_rank = [v for v in per_rank if v is not None]
    merged["tokens_per_s_per_rank"] = ({"min": min(per_rank), "median": statistics.median(per_rank)}
                                       if per_rank else None)
    # Keep the top-level figures consistent with the medians above.
    merged["median_step_time_s"] = merged["step_time_stats_s"]["median"]
    merged["host_us_per_param_per_step"] = host_us_per_param(merged["median_step_time_s"],
                                                             merged.get("parameter_tensors"))
    merged["tokens_per_s"] = (merged["tokens_per_s_per_rank"]["median"] * len(entries[0]["per_rank"])
                              if per_rank else None)
    wires = [e["wire_bytes_inter_node_per_step"] for e in entries if e["wire_bytes_inter_node_per_step"] is not None]
    if wires:
        merged["wire_bytes_inter_node_per_step"] = statistics.median(wires)
    # Like step time: the median over repeats of each repeat's steady-state median. The per-step lists and the
    # timeline stay the first repeat's (each repeat's lists are under "repeats").
    for key in ("exposed_comm_s_per_step", "comm_busy_s_per_step", "cpu_s_per_step", "boundary_wall_s",
                "boundary_critical_path_s", "boundary_other_s", "boundary_after_exchange_s",
                "boundary_after_exchange_critical_path_s"):
        values = [e[key] for e in entries if e.get(key) is not None]
        merged[key] = statistics.median(values) if values else None
    phases = [e["boundary_phase_s"] for e in entries if e.get("boundary_phase_s")]
    if phases:
        merged["boundary_phase_s"] = {kind: (statistics.median([p[kind] for p in phases if p[kind] is not None])
                                             if any(p[kind] is not None for p in phases) else None)
                                      for kind in phases[0]}
    if merged["cpu_s_per_step"] is not None:
        merged["host_cpu_us_per_param_per_step"] = host_us_per_param(merged["cpu_s_per_step"],
                                                                     merged.get("parameter_tensors"))
    return merged
