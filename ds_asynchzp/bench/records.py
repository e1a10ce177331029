"""A benchmark run's records on disk: `results.json` as the bench writes it, or gzipped once archived.

The per-step, per-rank records make a results.json of 1 to 2 MB per run; a run kept under `docs/benchmarks/`
keeps its summary, report and plots as they are and its records gzipped (`results.json.gz`, about a tenth), so
that the repository stays small. Every reader (the report, `asynchzp-plan --check`, a sweep's runs) goes through
`read_results`, which takes either form, and a path naming `results.json` finds its archived `.gz`.

    python -m ds_asynchzp.bench.records archive docs/benchmarks/<run>     # gzip every results.json under it
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path

GZ = ".gz"


def read_results(path) -> dict:
    """The JSON at `path`, or at `path` + ".gz" where only the archived form exists (or `path` ends in .gz)."""
    path = Path(path)
    if not path.exists() and not path.name.endswith(GZ) and path.with_name(path.name + GZ).exists():
        path = path.with_name(path.name + GZ)
    if path.name.endswith(GZ):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text(encoding="utf-8"))


def archive(directory) -> list:
    """Gzip every results.json under `directory` in place (results.json -> results.json.gz, written whole before
    the original goes); returns (path, bytes before, bytes after) of each."""
    done = []
    for path in sorted(Path(directory).rglob("results.json")):
        target = path.with_name(path.name + GZ)
        partial = target.with_name(target.name + ".partial")
        data = path.read_bytes()
        json.loads(data)  # refuse to archive a file that does not parse
        # mtime 0: the same records give the same bytes, so archiving twice changes nothing in git.
        with open(partial, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            f.write(data)
        os.replace(partial, target)
        path.unlink()
        done.append((path, len(data), target.stat().st_size))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_asynchzp.bench.records",
                                     description="Archive a benchmark run's records (gzip every results.json).")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("archive", help="gzip every results.json under DIR").add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        parser.error(f"{args.directory} is not a directory")
    done = archive(args.directory)
    for path, before, after in done:
        print(f"{path}: {before:,} -> {after:,} bytes")
    print(f"archived {len(done)} results.json under {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
