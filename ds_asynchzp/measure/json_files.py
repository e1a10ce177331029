"""Files written whole: the bench's results, asynchzp-ab's rank records, a launched rank's outcome. Imports nothing
heavy, so the CLIs and the rank entry that use it stay quick to start."""

from __future__ import annotations

import json
import os


def write_text_atomically(path, text: str) -> None:
    """Write `text` at `path` through a temporary file of this process: readers (and a crash mid-write) never see a
    half-written file."""
    path = str(path)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json_atomically(path, data: dict, indent: int | None = 2) -> None:
    write_text_atomically(path, json.dumps(data, indent=indent) + "\n")
