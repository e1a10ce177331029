"""Shared launch helper for the multi-rank tests: one launch trains several cases on CPU ranks."""

from __future__ import annotations

import os
from pathlib import Path

from ds_asynchzp.bench.launch import launch_local

REPO_ROOT = Path(__file__).resolve().parent.parent
# Per-launch limit: a hung collective is killed and reported instead of stalling the suite.
LAUNCH_TIMEOUT_S = float(os.environ.get("ASYNCHZP_TEST_TIMEOUT", "420"))


def run_cases(nproc: int, node_size: int, cases: list, register: bool = False) -> list:
    """Per-rank results of tests/_dist_workers.run_cases."""
    env = {"PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return launch_local("tests._dist_workers:run_cases", nproc, node_size, {"cases": cases, "register": register},
                        timeout_s=LAUNCH_TIMEOUT_S, env=env)
