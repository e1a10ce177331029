"""The comparison table of a benchmark run, as Markdown (printed, and saved as ``summary.md``).

Loss and byte columns are relative to the ``zero3`` arm when it was run, since stock ZeRO-3 is the
reference every other arm must match in loss and beat in inter-node traffic.
"""

from __future__ import annotations

import statistics

REFERENCE_ARM = "zero3"
MB = 1e6  # decimal megabytes, stated in the legend

# Pipes inside a cell are escaped so the Markdown table keeps its columns.
COLUMNS = ("arm", "final loss", r"max \|loss rel diff\| vs zero3", "intra MB/step", "inter MB/step",
           "inter ratio vs zero3", "median step s", "peak RSS MB", "model-state MB")


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
    return [
        arm,
        f"{losses[-1]:.6f}",
        rel_diff,
        f"{intra / MB:.3f}",
        f"{inter / MB:.3f}",
        ratio,
        f"{median:.3f}",
        f"{entry['peak_memory_bytes'] / MB:.1f}",
        f"{entry['model_state_bytes']['total'] / MB:.3f}",
    ]


def format_table(results: dict) -> str:
    """Markdown table of every arm in `results` (the results.json structure), plus a short legend."""
    arms = results["arms"]
    reference = arms.get(REFERENCE_ARM)
    rows = [list(COLUMNS)] + [_row(arm, entry, reference) for arm, entry in arms.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]

    def line(cells: list[str]) -> str:
        # Left-align the arm name, right-align numbers.
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    separator = "|" + "|".join(("-" * (w + 1) + ":") if i else (":" + "-" * (w + 1))
                               for i, w in enumerate(widths)) + "|"
    config = results.get("config", {})
    legend = (
        f"{config.get('model', '?')} model, {config.get('nproc', '?')} ranks in nodes of "
        f"{config.get('node_size', '?')}, {config.get('dtype', '?')}, {config.get('steps', '?')} optimizer steps x "
        f"{config.get('grad_accum', '?')} micro-steps (first {config.get('warmup_steps', '?')} excluded from "
        "step-time and byte averages).\n"
        "Bytes: ring-model wire bytes sent per rank per optimizer step (mean over ranks); MB = 10^6 bytes. "
        "Losses: mean over ranks. Step time: slowest rank. Peak RSS: largest rank. Model-state: rank 0."
    )
    return "\n".join([line(rows[0]), separator, *(line(r) for r in rows[1:]), "", legend])
