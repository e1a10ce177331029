"""JSON files written whole: the bench's results and asynchzp-ab's rank records. Imports nothing heavy, so the CLIs
that use it stay quick to start."""

from __future__ import annotations

import json
import os


def write_json_atomically(path, data: dict, indent: int | None = 2) -> None:
    """Write `data` as JSON at `path` through a temporary file: readers (and a crash mid-write) never see a
    half-written file."""
    path = str(path)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=indent) + "\n")
    os.replace(tmp, path)
