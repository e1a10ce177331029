"""What a benchmark run ran on, as results.json records it (``env``): the versions of torch, DeepSpeed, this
package and Python, the source's git commit, the host's CPUs and the date."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    repo = Path(__file__).resolve().parents[2]
    if not (repo / "pyproject.toml").is_file():
        return None  # an installed copy: any repository around it is not this package's source
    try:
        done = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def environment() -> dict:
    from ds_asynchzp import __version__

    return {
        "torch": _version("torch"),
        "deepspeed": _version("deepspeed"),
        "ds_asynchzp": __version__,
        "python": platform.python_version(),
        "git_commit": _git_commit(),
        "host_cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
