import os
import signal
import subprocess
import sys

import pytest

from ds_asynchzp.bench.launch import scripts_first_on_path
from tests.dist_harness import run_cases

# Every process the tests start finds this interpreter's ninja first, so DeepSpeed's JIT-built CPU op stays cached.
scripts_first_on_path(os.environ)

# Started in the background by a non-interactive shell, pytest inherits an ignored SIGINT, and so would every
# process it starts: the tests of Ctrl-C and of SIGINT teardown need it delivered, as in a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def deepspeed_cpu_ops():
    """Build the compiled ops the ranks load (DeepSpeed's CPU communication and Adam ops, the package's own)
    once, before any rank starts, as the bench does: a cold build (minutes on 2 cores) then never counts against
    a launch's timeout. Cached across runs."""
    build = "from ds_asynchzp.bench.launch import prepare_ops; prepare_ops()"
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, "-c", build], env=env, timeout=900, capture_output=True, text=True)
    assert done.returncode == 0, f"building the compiled ops failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"

# Optimizer steps of a parity case: 4 steady ones past the warm-up (the fetch order's recording, then the first
# prefetching step), and Adam has amplified the rounding of small gradients several times over.
STEPS = 6
# The racy cases run longer: every extra step is another chance for a race to change a bit.
RACY_STEPS = 10


def parity_cases(node_size: int, grad_accums=(1, 4), extra=(), steps: int = STEPS) -> list:
    """Stock ZeRO-3 then AsyncHZP for each grad accumulation, same model, data and seed (fp32)."""
    cases = []
    for gas in grad_accums:
        cases.append({"name": f"zero3_gas{gas}", "gas": gas, "steps": steps})
        cases.append({"name": f"asynchzp_gas{gas}", "gas": gas, "steps": steps, "async_hzp": {"node_size": node_size},
                      "compare_to": f"zero3_gas{gas}"})
    return cases + list(extra)


def layout_case(node_size: int, d_p: int, d_g: int, d_o: int, gas: int = 4, defaults: bool = False,
                steps: int = STEPS, **extra) -> dict:
    """AsyncHZP with explicit shard sizes, compared with stock ZeRO-3 under the same knobs."""
    knobs = "defaults_" if defaults else ""
    return dict({"name": f"asynchzp_{knobs}p{d_p}_g{d_g}_o{d_o}_gas{gas}", "gas": gas, "steps": steps,
                 "default_knobs": defaults, "compare_to": f"zero3_{knobs}gas{gas}",
                 "async_hzp": {"node_size": node_size, "param_shard_size": d_p, "grad_shard_size": d_g,
                               "optimizer_shard_size": d_o}}, **extra)


def defaults_baseline(gas: int = 4) -> dict:
    """Stock ZeRO-3 with DeepSpeed's default knobs (persistence, prefetch, live parameters, reuse, overlap)."""
    return {"name": f"zero3_defaults_gas{gas}", "gas": gas, "steps": STEPS, "default_knobs": True}


# User-facing behaviours checked against stock ZeRO-3 doing exactly the same: a weight edited through
# GatheredParameters(modifier_rank=0), a backward thrown away with zero_grad(), safe_get_full_grad between the
# last backward and step(), and a second (stock) engine on the same module after destroy().
HAZARDS = {"modify_at": 3, "discard_backward_at": 5, "safe_grad": True, "then_stock_steps": 2, "hazard_case": True}

def async_cases(node_size: int, sizes: dict = None, suffix: str = "gas2") -> list:
    """The same placement synchronous (`async_comm: false`), then asynchronous with a random 0-10 ms delay
    before and after every collective of every thread (seeded): the delays widen every race window, and the
    losses must stay bit-identical to the synchronous run over RACY_STEPS steps. Two micro-steps per step (the
    accumulation and the boundary are both exercised) keep the delays' cost in the suite moderate."""
    section = dict({"node_size": node_size}, **(sizes or {}))
    return [
        {"name": f"asynchzp_sync_{suffix}", "gas": 2, "steps": RACY_STEPS,
         "async_hzp": dict(section, async_comm=False)},
        {"name": f"asynchzp_racy_{suffix}", "gas": 2, "steps": RACY_STEPS, "compare_to": f"asynchzp_sync_{suffix}",
         "async_hzp": section, "comm_delay": "0:10:7", "expect_bit_identical": True},
    ]


# The overlap measurement: a fixed 1 ms delay before and after every collective (a latency the threads can hide
# behind compute), synchronous then asynchronous, on a model whose modules compute for longer than that.
_OVERLAP = {"gas": 2, "steps": 4, "model": "small", "micro_batch": 12, "seq_len": 128, "comm_delay": "1",
            "timing_case": True, "zero": {"reduce_bucket_size": 200000}}
OVERLAP_CASES = [
    dict(_OVERLAP, name="overlap_sync", async_hzp={"node_size": 2, "async_comm": False}),
    dict(_OVERLAP, name="overlap_async", async_hzp={"node_size": 2}, compare_to="overlap_sync"),
]

# (world, node_size) -> the cases its launch trains. Tests of several files share one launch per layout.
LAUNCHES = {
    (2, 2): parity_cases(2, extra=async_cases(2) + OVERLAP_CASES),
    (4, 2): parity_cases(2, extra=[
        # d_p < node size and d_o = node size (optimizer replicas all-reduced across nodes).
        layout_case(2, 1, 2, 2, check_shards=True),
        # The same run checkpointed after 3 steps and resumed in a fresh engine (DeepSpeed's format, d_o < N).
        dict(layout_case(2, 1, 2, 2), name="resumed_p1_g2_o2_gas4", resume_at=3,
             compare_to="asynchzp_p1_g2_o2_gas4"),
        # d_g > d_p and d_g spanning both nodes; synchronous, so that every allocation of the communication
        # path happens on the training thread, where the allocation recorder sees it.
        # The boundary threads' cross-node flows (all-to-all and optimizer-replica all-reduce) under random delays.
        *async_cases(2, {"param_shard_size": 1, "grad_shard_size": 2, "optimizer_shard_size": 2},
                     suffix="p1_g2_o2_gas2"),
        dict(layout_case(2, 1, 4, 4, record_allocations=True),
             async_hzp={"node_size": 2, "param_shard_size": 1, "grad_shard_size": 4, "optimizer_shard_size": 4,
                        "async_comm": False}),
        # zero_optimization.reduce_scatter = false: the grad shard group all-reduces instead, as stock does.
        dict(layout_case(2, 2, 2, 4), name="asynchzp_allreduce_gas4", zero={"reduce_scatter": False}),
        defaults_baseline(),
        layout_case(2, 2, 2, 4, defaults=True, check_shards=True),
        layout_case(2, 1, 2, 2, defaults=True),
        dict(defaults_baseline(2), name="zero3_hazards", **HAZARDS),
        dict(layout_case(2, 1, 2, 2, gas=2, defaults=True), name="asynchzp_hazards", compare_to="zero3_hazards",
             **HAZARDS),
        # Nothing sharded inside a node (d_p = d_g = 1), optimizer states over the world: a boundary exchange and
        # refresh over all 4 ranks (T = 4 rows), 2 on each node.
        layout_case(2, 1, 1, 4, check_shards=True),
        # Last: DeepSpeed creates its hpZ group once per process, and every later engine would inherit it.
        {"name": "hpz_gas4", "gas": 4, "steps": STEPS, "zero": {"zero_hpz_partition_size": 2}},
    ]),
    (8, 4): parity_cases(4, grad_accums=(2,), extra=[
        # d_p < d_g inside the node, d_o = node size.
        layout_case(4, 2, 4, 4, gas=2),
    ]),
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
