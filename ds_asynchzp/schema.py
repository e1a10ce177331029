"""Write or check the JSON Schema of the ``async_hzp`` ds_config section.

    python -m ds_asynchzp.schema          # (re)write config_schema/async_hzp.schema.json
    python -m ds_asynchzp.schema --check  # exit 1 if the checked-in file is stale

The schema is generated from :class:`ds_asynchzp.config.AsyncHZPConfig` so the
file editors and validators see can never drift from what the code accepts.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

from .config import AsyncHZPConfig

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "config_schema" / "async_hzp.schema.json"


def render_schema() -> str:
    """The schema text exactly as it is checked in: sorted keys, indent 2, trailing newline."""
    schema = AsyncHZPConfig.model_json_schema()
    # No "$id": the file is consumed by path, and a URL here would have to be kept valid.
    schema.pop("$id", None)
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_asynchzp.schema", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the file differs")
    args = parser.parse_args(argv)

    expected = render_schema()
    if not args.check:
        SCHEMA_PATH.parent.mkdir(parents=True, exist_ok=True)
        SCHEMA_PATH.write_text(expected)
        print(f"wrote {SCHEMA_PATH}")
        return 0

    current = SCHEMA_PATH.read_text() if SCHEMA_PATH.exists() else ""
    if current == expected:
        return 0
    diff = difflib.unified_diff(current.splitlines(keepends=True), expected.splitlines(keepends=True),
                                fromfile=f"{SCHEMA_PATH} (checked in)", tofile="generated from AsyncHZPConfig")
    sys.stdout.writelines(diff)
    print(f"\n{SCHEMA_PATH} is out of date; regenerate it with: python -m ds_asynchzp.schema")
    return 1


if __name__ == "__main__":
    sys.exit(main())
