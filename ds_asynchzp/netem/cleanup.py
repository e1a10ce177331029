"""Remove what killed emulated-cluster runs left behind: ``python -m ds_asynchzp.netem.cleanup`` (as root).

Only touches namespaces named ``ahzp*`` and processes recorded in ``/tmp/ahzp-netem/*.json`` whose command line
still identifies them as ours. Namespaces of runs whose owner process is alive are kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from . import tracking
from .topology import NAMESPACE_PREFIX


def _delete_namespace(ns: str, dry_run: bool) -> bool:
    if dry_run:
        print(f"would delete namespace {ns}")
        return True
    killed = tracking.kill_namespace_processes(ns)
    if killed:
        print(f"killed processes inside {ns}: {killed}")
    proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"could not delete namespace {ns}: {proc.stderr.strip()}", file=sys.stderr)
        return False
    print(f"deleted namespace {ns}")
    return True


def cleanup(force: bool = False, dry_run: bool = False) -> int:
    """Returns the number of things that could not be removed."""
    failures = 0
    existing = set(tracking.list_namespaces())
    # Recorded runs first: they also name the relay and watchdog processes to stop.
    for prefix, state in tracking.read_states().items():
        if tracking.pid_alive(state.get("owner_pid")) and not force:
            print(f"keeping {prefix}: its owner pid {state.get('owner_pid')} is still running (use --force)")
            continue
        markers = {"relay_pid": tracking.relay_marker(prefix),
                   "watchdog_pid": f"ahzp-netem-watchdog {prefix}"}
        for key, marker in markers.items():
            pid = state.get(key)
            if dry_run:
                if tracking.pid_alive(pid) and marker in tracking.process_cmdline(pid):
                    print(f"would stop {key[:-4]} pid {pid}")
            elif tracking.stop_process(pid, marker, group=key == "watchdog_pid"):
                print(f"stopped {key[:-4]} pid {pid} of {prefix}")
        for ns in state.get("namespaces", []):
            if ns.startswith(NAMESPACE_PREFIX) and ns in existing:
                failures += not _delete_namespace(ns, dry_run)
                existing.discard(ns)
        if not dry_run:
            tracking.remove_state(prefix)
    # Then unrecorded ones (e.g. killed before the state file was written).
    leftovers = set(tracking.find_leftovers())
    for ns in sorted(existing):
        if ns.startswith(NAMESPACE_PREFIX) and (force or ns in leftovers):
            failures += not _delete_namespace(ns, dry_run)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_asynchzp.netem.cleanup", description=__doc__.split("\n")[0])
    parser.add_argument("--force", action="store_true",
                        help=f"also remove {NAMESPACE_PREFIX}* namespaces of runs that are still alive")
    parser.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    args = parser.parse_args(argv)
    failures = cleanup(force=args.force, dry_run=args.dry_run)
    if failures:
        print(f"{failures} item(s) could not be removed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
