"""The report's table of the bytes of models that train nothing (a DPO reference model), per arm: the collectives
their forwards issued, which the ledger labels by model (`platform.ledger.model_scope`) where node links, and
under stock ZeRO-3 process groups, cannot tell them from the trained model's."""

from __future__ import annotations

from .table import markdown_table


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3f}"


def format_model_table(arms: dict) -> list[str]:
    """Markdown lines, or none when no arm ran a labelled model."""
    rows = []
    for arm, entry in arms.items():
        steady = entry.get("bytes_per_step_by_model") or {}
        by_step = entry.get("bytes_by_model_by_step") or {}
        total = (entry.get("bytes_per_step") or {}).get("inter_node") or 0.0
        for model, figures in steady.items():
            steps = by_step.get(model) or []
            first = _mb(steps[0]["inter_node"]) if steps else "-"
            later = ", ".join(_mb(s["inter_node"]) for s in steps[1:]) or "-"
            share = f"{figures['inter_node'] / total:.1%}" if total else "-"
            rows.append([arm, model, first, later, _mb(figures["inter_node"]), share, _mb(figures["link_bytes"]),
                         _mb(figures["intra_node"])])
    if not rows:
        return []
    return ["## Models without an optimizer", "",
            *markdown_table([["arm", "model", "inter MB, step 1", "inter MB, steps 2...", "inter MB/step (steady)",
                              "share of the arm's inter-node bytes", "node-link MB/step (ledger)",
                              "intra MB/step"], *rows], text_columns=2), "",
            "Per rank: the collectives issued on the training thread during the forwards of engines built without "
            "an optimizer (a reference model), counted by the ledger (ring model: what a rank sends; inter when the "
            "group spans nodes; node-link: what gloo's rings put on the links between nodes). Link counters cannot "
            "tell models apart, and under stock ZeRO-3 neither can process groups (both models gather over the "
            "world), so the ledger labels them by the engine whose forward issued them. A step holds what its "
            "training thread issued since the step before ended; the first step only what came after its first "
            "forward (a reference forward run before it, as GRPO runs one, is in no step).", ""]
