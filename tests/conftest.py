import pytest

from tests.dist_harness import run_cases

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
def launched():
    """Memoised launches: `launched(world, node_size)` -> per-rank results."""
    cache = {}

    def get(world: int, node_size: int) -> list:
        key = (world, node_size)
        if key not in cache:
            cache[key] = run_cases(world, node_size, LAUNCHES[key])
        return cache[key]

    return get
