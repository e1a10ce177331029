import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness import run_cases

# DeepSpeed JIT-builds a CPU communication op with ninja the first time a process initialises it. ninja's build
# records differ between versions, so processes that find different ninja binaries keep rebuilding the shared
# cache: put this interpreter's bin (the virtual environment's ninja) first on PATH for every process we start.
_BIN_DIR = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN_DIR:
    os.environ["PATH"] = _BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@pytest.fixture(scope="session")
def deepspeed_cpu_ops():
    """Build DeepSpeed's CPU op once, before any rank starts, so a cold build (minutes on 2 cores) never
    counts against a launch's timeout. Cached across runs by torch."""
    build = ("from deepspeed.accelerator import get_accelerator; "
             "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, "-c", build], env=env, timeout=900, capture_output=True, text=True)
    assert done.returncode == 0, f"building DeepSpeed's CPU op failed:\n{done.stderr[-4000:]}"

STEPS = 10


def parity_cases(node_size: int, grad_accums=(1, 4), extra=()) -> list:
    """Stock ZeRO-3 then AsyncHZP for each grad accumulation, same model, data and seed (fp32)."""
    cases = []
    for gas in grad_accums:
        cases.append({"name": f"zero3_gas{gas}", "gas": gas, "steps": STEPS})
        cases.append({"name": f"asynchzp_gas{gas}", "gas": gas, "steps": STEPS, "async_hzp": {"node_size": node_size},
                      "compare_to": f"zero3_gas{gas}"})
    return cases + list(extra)


# (world, node_size) -> the cases its launch trains. Tests of several files share one launch per layout.
LAUNCHES = {
    (2, 2): parity_cases(2),
    (4, 2): parity_cases(2),
    (8, 2): parity_cases(2, grad_accums=(4,)),
    (8, 4): parity_cases(4, extra=[{"name": "hpz_gas4", "gas": 4, "steps": STEPS,
                                   "zero": {"zero_hpz_partition_size": 4}}]),
}


@pytest.fixture(scope="session")
def launched(deepspeed_cpu_ops):
    """Memoised launches: `launched(world, node_size)` -> per-rank results."""
    cache = {}

    def get(world: int, node_size: int) -> list:
        key = (world, node_size)
        if key not in cache:
            cache[key] = run_cases(world, node_size, LAUNCHES[key])
        return cache[key]

    return get
