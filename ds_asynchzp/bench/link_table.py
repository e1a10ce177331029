"""The report's table of bytes counted on each emulated link: per arm, per optimizer step, what left each node's
link (one per node) or each rank's (rails), as the links' transmit counters saw it, frame headers included."""

from __future__ import annotations

from .table import MB, markdown_table


def topology_text(config: dict) -> str:
    topology = (config.get("network") or {}).get("topology") or "shared"
    return ("one link per rank (rails: bytes for a rank of local index j leave on rail j)" if topology == "rails"
            else "one link per node, shared by its ranks")


def format_link_table(arms: dict, config: dict) -> list[str]:
    """``## Node links`` where a run counted bytes per link (`wire_bytes_by_link_per_step`); nothing otherwise."""
    counted = {arm: entry.get("wire_bytes_by_link_per_step") for arm, entry in arms.items()}
    names = sorted({name for links in counted.values() if links for name in links},
                   key=lambda n: [int(part) if part.isdigit() else part
                                  for part in n.replace("node", "").replace("/eth", " ").split()])
    if not names:
        return []
    rows = [[arm, *(f"{links[n] / MB:.3f}" if links and n in links else "n/a" for n in names),
             f"{max(links.values()) / MB:.3f}" if links else "n/a"] for arm, links in counted.items()]
    return ["## Node links", "",
            f"Bytes that left each emulated link per optimizer step, counted by the link's transmit counter (MB = "
            f"10^6 bytes, frame headers and acknowledgements included; steady steps): {topology_text(config)}. "
            "`asynchzp-plan --check results.json` compares each with the model's bytes for that link.", "",
            *markdown_table([["arm", *names, "busiest"], *rows]), ""]
