"""A benchmark run's arm entries rebuilt from the rank records its logs keep, with this version's aggregation: after
the aggregation gains a figure, a run's results get it without running again.

    python -m ds_asynchzp.bench.reaggregate <run dir>     # then: python -m ds_asynchzp.bench.report <run dir>/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .aggregate import aggregate_arm, merge_repeats
from .arms import arm_dir_name
from .offload import add_offload_figures
from .records import read_results


def reaggregate(run_dir) -> list:
    """Rebuild every arm entry of `run_dir`/results.json from the rank records its logs keep
    (`logs/<arm>[-<repeat>]/rank<r>.result.json`), with this version's aggregation: after the aggregation gains a
    figure, a run's results get it without running again. Returns the arms rebuilt; the file is rewritten whole."""
    run_dir = Path(run_dir)
    results = read_results(run_dir / "results.json")
    config = results["config"]
    tokens = config.get("tokens_per_optimizer_step") or 0
    rebuilt = []
    for arm in list(results["arms"]):
        name = arm_dir_name(arm)
        runs = sorted(run_dir.glob(f"logs/{name}-*"), key=lambda d: int(d.name.rsplit("-", 1)[1])) or \
            [run_dir / "logs" / name]
        entries = []
        for workdir in runs:
            ranks = [json.loads(f.read_text())["result"] for f in sorted(workdir.glob("rank*.result.json"))]
            if len(ranks) != int(config["nproc"]):
                raise ValueError(f"{workdir}: {len(ranks)} rank records for {config['nproc']} ranks")
            entries.append(aggregate_arm(ranks, int(config["warmup_steps"]), tokens))
        wall = results["arms"][arm].get("wall_time_s")   # the launch's own time, which the records do not hold
        results["arms"][arm] = dict(merge_repeats(entries), wall_time_s=wall)
        add_offload_figures(results, arm)
        rebuilt.append(arm)
    partial = run_dir / "results.json.partial"
    partial.write_text(json.dumps(results, indent=1))
    os.replace(partial, run_dir / "results.json")
    return rebuilt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_asynchzp.bench.reaggregate",
                                     description="Rebuild DIR/results.json's arm entries from the rank records under "
                                     "DIR/logs (then regenerate the report: python -m ds_asynchzp.bench.report "
                                     "DIR/results.json).")
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    if not (args.directory / "logs").is_dir():
        parser.error(f"{args.directory} has no logs directory of rank records")
    print(f"rebuilt {', '.join(reaggregate(args.directory))} in {args.directory / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
