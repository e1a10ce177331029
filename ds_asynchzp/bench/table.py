"""The comparison table of a benchmark run, as Markdown (printed, and saved as ``summary.md``).

Loss and byte columns are relative to the ``zero3`` arm when it was run, since stock ZeRO-3 is the
reference every other arm must match in loss and beat in inter-node traffic.
"""

from __future__ import annotations

import statistics

from ..models.gpt import HOST_OVERHEAD_PRESET
from .offload import format_offload_table

REFERENCE_ARM = "zero3"
MB = 1e6  # decimal megabytes, stated in the legend

# Pipes inside a cell are escaped so the Markdown table keeps its columns.
COLUMNS = ("arm", "final loss", r"max \|loss rel diff\| vs zero3", "intra MB/step", "inter MB/step",
           "inter ratio vs zero3", "median step s", "exposed comm s/step", "comm busy s/step", "peak RSS MB",
           "model-state MB")
# Model-state roles in a fixed order (parameters, gradients, master weights, optimizer states); roles recorded by
# `ds_asynchzp.measure.memory.model_state_bytes` but not listed here follow, sorted.
ROLE_ORDER = ("param_primary", "param_secondary", "param_shard", "grad_primary", "grad_shard", "master",
              "optimizer_state")
# layout key -> its short name in the tables.
SHARD_SIZES = (("param_shard_size", "d_p"), ("grad_shard_size", "d_g"), ("optimizer_shard_size", "d_o"))


def max_rel_loss_diff(losses: list[float], reference: list[float]) -> float:
    """Largest |loss - reference| / |reference| over the optimizer steps."""
    return max(abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(losses, reference))


def _row(arm: str, entry: dict, reference: dict | None) -> list[str]:
    na = "n/a"
    losses = entry["losses"]
    intra, inter = entry["bytes_per_step"]["intra_node"], entry["bytes_per_step"]["inter_node"]
    if reference is None:
        rel_diff = ratio = na
    else:
        rel_diff = f"{max_rel_loss_diff(losses, reference['losses']):.2e}"
        ref_inter = reference["bytes_per_step"]["inter_node"]
        ratio = f"{inter / ref_inter:.3f}" if ref_inter else na
    median = entry.get("median_step_time_s")
    if median is None:
        median = statistics.median(entry["step_time_s"])
    # Only results that also carry busy time have the training-thread meaning of "exposed" (see the legend).
    exposed, busy = entry.get("exposed_comm_s_per_step"), entry.get("comm_busy_s_per_step")
    if busy is None:
        exposed = None
    return [
        arm,
        f"{losses[-1]:.6f}",
        rel_diff,
        f"{intra / MB:.3f}",
        f"{inter / MB:.3f}",
        ratio,
        f"{median:.3f}",
        na if exposed is None else f"{exposed:.3f}",
        na if busy is None else f"{busy:.3f}",
        f"{entry['peak_memory_bytes'] / MB:.1f}",
        f"{entry['model_state_bytes']['total'] / MB:.3f}",
    ]


# Column title -> results.json key, shown on the host-overhead preset.
HOST_COLUMNS = {"host us/param/step": "host_us_per_param_per_step",
                "host CPU us/param/step": "host_cpu_us_per_param_per_step"}
HOST_LEGEND = (
    "Host us/param/step: median step time / the model's parameter tensors ({tensors}), in microseconds. On the "
    f"`{HOST_OVERHEAD_PRESET}` preset (many tiny tensors, no arithmetic to speak of) the step is the per-parameter "
    "host work of fetching, releasing and reducing every parameter, so this is that work per parameter per optimizer "
    "step (in brackets: relative to zero3); on a fast GPU it is the step time. Host CPU: the same with the CPU time "
    "of a rank's process (all its threads) per step, slowest rank, median over steady steps: on a shared host, other "
    "load moves step times far more than CPU times.")


def shows_host_overhead(results: dict) -> bool:
    """Whether the tables show host time per parameter: only on the preset built to measure it (elsewhere step time
    per tensor is mostly arithmetic)."""
    return (results.get("config") or {}).get("model") == HOST_OVERHEAD_PRESET


def host_legend(arms: dict) -> str:
    tensors = sorted({e.get("parameter_tensors") for e in arms.values()} - {None})
    return HOST_LEGEND.format(tensors=", ".join(map(str, tensors)) or "not recorded")


def host_cells(entry: dict, reference: dict | None) -> list[str]:
    """The arm's host microseconds per parameter per step (`HOST_COLUMNS`), each with its ratio to the reference
    arm's."""
    cells = []
    for key in HOST_COLUMNS.values():
        value, ref = entry.get(key), (reference or {}).get(key)
        cells.append("n/a" if value is None else f"{value:.0f}" + (f" ({value / ref:.2f}x)" if ref else ""))
    return cells


def memory_roles(arms: dict) -> list[str]:
    """Every model-state role any arm recorded (the union), in `ROLE_ORDER`; "total" is not a role."""
    roles = {r for e in arms.values() for r in (e.get("model_state_bytes") or {}) if r != "total"}
    return [r for r in ROLE_ORDER if r in roles] + sorted(roles - set(ROLE_ORDER))


def role_bytes(entry: dict, role: str) -> float:
    """Bytes of one role on rank 0; 0 where the arm has no such role."""
    return (entry.get("model_state_bytes") or {}).get(role) or 0


def layout_cells(entry: dict) -> tuple[str, str]:
    """("d_p/d_g/d_o", "replicas p/g/o") of an arm's recorded layout; "n/a" when the run did not record one."""
    layout = entry.get("layout") or {}
    world = layout.get("world_size")
    sizes = [layout.get(key) for key, _ in SHARD_SIZES]
    if not world or not all(isinstance(v, int) and v > 0 for v in sizes):
        return "n/a", "n/a"
    return "/".join(map(str, sizes)), "/".join(str(world // v) for v in sizes)


LAYOUT_LEGEND = (
    "Layout: d_p / d_g / d_o = ranks a parameter / gradient / optimizer-state shard is split over, as the arm "
    "resolved them; replicas = world size / shard size. For hpz, d_p is the secondary (hpZ) parameter partition "
    "the micro-steps gather from; its primary partition spans the world.")


def markdown_table(rows: list[list[str]], text_columns: int = 1) -> list[str]:
    """Padded Markdown table of a header row and data rows; the first `text_columns` columns (names) left-aligned,
    the rest (numbers) right-aligned."""
    rows = [[c.replace("|", r"\|") for c in rows[0]], *rows[1:]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(cells: list[str]) -> str:
        padded = [c.ljust(w) if i < text_columns else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    separator = "|" + "|".join((":" + "-" * (w + 1)) if i < text_columns else ("-" * (w + 1) + ":")
                               for i, w in enumerate(widths)) + "|"
    return [line(rows[0]), separator, *(line(r) for r in rows[1:])]


def format_layout_memory_table(results: dict) -> str:
    """Per arm: resolved layout and model-state MB per role (union of the arms' roles, 0 where absent), total."""
    arms = results["arms"]
    roles = memory_roles(arms)
    header = ["arm", "d_p/d_g/d_o", "replicas p/g/o", *(f"{r} MB" for r in roles), "model-state total MB"]
    rows = [header]
    for arm, entry in arms.items():
        total = (entry.get("model_state_bytes") or {}).get("total")
        rows.append([arm, *layout_cells(entry), *(f"{role_bytes(entry, r) / MB:.3f}" for r in roles),
                     "n/a" if total is None else f"{total / MB:.3f}"])
    return "\n".join(markdown_table(rows, text_columns=3))


FAMILIES = ("dense", "expert", "tokens")


def format_family_table(results: dict) -> str | None:
    """Bytes per step split into dense parameters, AutoEP's experts and its token all-to-all, with each arm's
    expert layout; None when no arm moved expert or token bytes."""
    arms = results["arms"]
    split = {arm: e.get("bytes_per_step_by_family") or {} for arm, e in arms.items()}
    if not any(f in per for per in split.values() for f in ("expert", "tokens")):
        return None
    header = ["arm"] + [f"{f} {w} MB/step" for f in FAMILIES for w in ("intra", "inter")] + ["expert layout"]
    rows = [header]
    for arm, per in split.items():
        families = arms[arm].get("families") or {}
        expert = next((v for k, v in families.items() if k != "dense"), None)
        text = ("stock: over the expert-data-parallel group" if expert is None else
                f"d_p/d_g/d_o {expert['param_shard_size']}/{expert['grad_shard_size']}/"
                f"{expert['optimizer_shard_size']} of {expert['world']} ({expert['world'] // expert['node_size']} "
                f"node(s) x {expert['node_size']})")
        rows.append([arm] + [f"{per.get(f, {}).get(w, 0.0) / MB:.3f}" for f in FAMILIES
                             for w in ("intra_node", "inter_node")] + [text])
    legend = ("dense: every parameter but the routed experts; expert: the experts' gathers, reductions and "
              "refresh; tokens: AutoEP's token all-to-all over the expert-parallel group (issued by DeepSpeed).")
    return "\n".join([*markdown_table(rows), "", legend])


def format_table(results: dict) -> str:
    """Markdown table of every arm in `results` (the results.json structure), plus a short legend."""
    arms = results["arms"]
    reference = arms.get(REFERENCE_ARM)
    host = shows_host_overhead(results)
    rows = [list(COLUMNS) + list(HOST_COLUMNS) * host]
    rows += [_row(arm, entry, reference) + host_cells(entry, reference) * host for arm, entry in arms.items()]
    config = results.get("config", {})
    legend = (
        (f"`{config['command']}`: {config.get('world_size', '?')} ranks in nodes of {config.get('node_size', '?')}, "
         f"{config.get('steps', '?')} optimizer steps per arm (first {config.get('warmup_steps', '?')} excluded "
         "from step-time and byte averages).\n" if config.get("command") else
         f"{config.get('model', '?')} model, {config.get('nproc', '?')} ranks in nodes of "
         f"{config.get('node_size', '?')}, {config.get('dtype', '?')}, {config.get('steps', '?')} optimizer steps x "
         f"{config.get('grad_accum', '?')} micro-steps (first {config.get('warmup_steps', '?')} excluded from "
         "step-time and byte averages).\n") +
        "Bytes: ring-model wire bytes sent per rank per optimizer step (mean over ranks); MB = 10^6 bytes. "
        "Losses: mean over ranks. Step time: slowest rank. Peak RSS: largest rank. Model-state: rank 0.\n"
        "Exposed comm: time the training thread was blocked on communication; comm busy: time any collective was "
        "in flight, on any thread; both per step the largest over ranks, median over steady steps. Communication "
        "hidden behind compute shows as busy >> exposed."
    )
    if host:
        legend += "\n" + host_legend(arms)
    notes = [f"- {arm}: not run: {why}" for arm, why in (results.get("unavailable_arms") or {}).items()]
    notes += [f"- {arm}: FAILED: {why}" for arm, why in (results.get("failed_arms") or {}).items()]
    families = format_family_table(results)
    if families is not None:
        notes += ["", "Bytes by family (AutoEP):", "", families]
    offload = format_offload_table(results)
    return "\n".join([*markdown_table(rows), "", legend, *([""] + notes if notes else []), "",
                      "Layout and model-state memory per role (rank 0):", "",
                      format_layout_memory_table(results), "", LAYOUT_LEGEND,
                      *(["", *offload[2:]] if offload else [])])
