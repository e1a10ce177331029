"""The GPU check's report: one JSON file (everything measured) and one markdown page (what a reader needs),
both named by date and device, and the verdict: did every check pass.

The result is a plain dict, built by `cli.run_checks`:

    {"date", "commit", "device": {...}, "versions": {...}, "settings": {...},
     "checks": [{"name", "passed": bool | None, "summary", "details": {...}}, ...]}

`passed` None means the check could not run here (the summary says why), or, with `"measured": true`, that it
is a measurement with nothing to pass or fail; neither fails the verdict.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Tuple


def verdict(result: Dict) -> bool:
    """True when no check failed (a check that could not run is not a failure)."""
    return all(check["passed"] is not False for check in result["checks"])


def _mark(check: Dict) -> str:
    if check["passed"] is None and check.get("measured"):
        return "measured"
    return {True: "pass", False: "**FAIL**", None: "not run"}[check["passed"]]


def _table(rows) -> str:
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for column in columns:
            value = row.get(column)
            cells.append(f"{value:.4g}" if isinstance(value, float) else ("" if value is None else str(value)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(result: Dict) -> str:
    device = result["device"]
    lines = [f"# GPU check: {device.get('name', 'unknown device')}", "",
             f"Date {result['date']}, commit `{result['commit']}`, {device.get('count', 0)} GPU(s) "
             f"({device.get('memory_gib', '?')} GiB each), torch {result['versions'].get('torch')}, DeepSpeed "
             f"{result['versions'].get('deepspeed')}, CUDA {result['versions'].get('cuda')}.", "",
             f"**Verdict: {'every check passed' if verdict(result) else 'a check failed'}.**", "",
             "| check | result | summary |", "|---|---|---|"]
    for check in result["checks"]:
        summary = check["summary"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {check['name']} | {_mark(check)} | {summary} |")
    lines += ["", "Settings: " + ", ".join(f"{k} = {v}" for k, v in result["settings"].items()), ""]
    for check in result["checks"]:
        rows = check.get("details", {}).get("rows")
        if rows:
            legend = check.get("details", {}).get("legend")
            lines += [f"## {check['name']}", "", _table(rows), "", *([legend, ""] if legend else [])]
        for arm, tail in check.get("details", {}).get("failure tails", {}).items():
            lines += [f"## {check['name']}: the end of arm '{arm}''s failure", "", "```", tail, "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def file_stem(result: Dict) -> str:
    device = re.sub(r"[^A-Za-z0-9]+", "-", result["device"].get("name", "device")).strip("-").lower()
    return f"gpu-check-{result['date']}-{device or 'device'}"


def write_report(result: Dict, out_dir) -> Tuple[Path, Path]:
    """Write `<stem>.json` and `<stem>.md` into `out_dir` (created); their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = file_stem(result)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    md_path.write_text(render_markdown(result), encoding="utf-8")
    return json_path, md_path
