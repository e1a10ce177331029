"""Communication ledger against the analytic formulas of ds_asynchzp.traffic (docs/ARCHITECTURE.md).

Every arm runs with the same ZeRO-3 knobs (tests/_dist_workers.ZERO3_KNOBS: persistence thresholds, live
parameters, reuse distance and prefetch all 0, so ZeRO-3 gathers every parameter in forward and again in
backward). Bytes are ring-model wire bytes per rank, averaged over ranks and over steady-state steps (steps 0
and 1 carry DeepSpeed's trace-order checks and are left out).
"""

import pytest

from ds_asynchzp.formulas.traffic import TrafficInputs, asynchzp_bytes, hpz_bytes, zero3_bytes

WORLD, NODE = 4, 2
FIRST_STEADY_STEP = 2
FORMULA_RTOL = 0.01


def _measured(results, case):
    """Mean over ranks of the ledger's intra/inter bytes per steady optimizer step (measured by the worker over
    all steady steps at once: the parameter refresh of one step runs into the next)."""
    out = {"intra_node": 0.0, "inter_node": 0.0}
    for rank_result in results:
        for where in out:
            out[where] += rank_result[case]["steady_per_step"][where]
    return {k: v / len(results) for k, v in out.items()}


def _inputs(results, case, gas):
    elements = results[0][case]["elements_by_optimizer_group"] or results[0][case]["elements"]
    return TrafficInputs(world=WORLD, node_size=NODE, grad_accum=gas, gathered_elements=elements["gathered"],
                         reduced_elements=elements["reduced"], trainable_elements=elements["trainable"])


def _assert_close(measured, predicted, label):
    for where in ("intra_node", "inter_node"):
        m, p = measured[where], predicted[where]
        assert abs(m - p) <= FORMULA_RTOL * max(p, 1.0), f"{label} {where}: measured {m:.0f} B, formula {p:.0f} B"


@pytest.fixture(scope="module")
def results(launched):
    return launched(WORLD, NODE)


@pytest.mark.parametrize("gas", [1, 4])
def test_zero3_matches_formula(results, gas):
    _assert_close(_measured(results, f"zero3_gas{gas}"), zero3_bytes(_inputs(results, f"zero3_gas{gas}", gas)), "zero3")


@pytest.mark.parametrize("gas", [1, 4])
def test_asynchzp_matches_formula(results, gas):
    predicted = asynchzp_bytes(_inputs(results, f"asynchzp_gas{gas}", gas), param_shard_size=NODE,
                               grad_shard_size=NODE, optimizer_shard_size=WORLD)
    _assert_close(_measured(results, f"asynchzp_gas{gas}"), predicted, "asynchzp")


def test_asynchzp_with_optimizer_shards_inside_a_node_matches_formula(results):
    """d_p = 1 < d_g = 2 = d_o: no boundary exchange inside the optimizer group, one all-reduce across nodes."""
    case = "asynchzp_p1_g2_o2_gas4"
    predicted = asynchzp_bytes(_inputs(results, case, 4), param_shard_size=1, grad_shard_size=2, optimizer_shard_size=2)
    _assert_close(_measured(results, case), predicted, case)


def test_asynchzp_with_nothing_sharded_inside_a_node_matches_formula(results):
    """d_p = d_g = 1, d_o = 4: no micro-step traffic; the boundary exchange and refresh over all 4 ranks."""
    case = "asynchzp_p1_g1_o4_gas4"
    predicted = asynchzp_bytes(_inputs(results, case, 4), param_shard_size=1, grad_shard_size=1, optimizer_shard_size=4)
    _assert_close(_measured(results, case), predicted, case)
    assert predicted["by_flow"]["param_gather"]["intra_node"] == predicted["by_flow"]["grad_reduce_scatter"][
        "intra_node"] == 0


def test_no_point_to_point_in_steady_state(results):
    for name in ("asynchzp_gas1", "asynchzp_gas4", "asynchzp_p1_g2_o2_gas4", "asynchzp_p1_g1_o4_gas4"):
        for rank_result in results:
            for step in rank_result[name]["ledger_steps"][FIRST_STEADY_STEP:]:
                assert "send" not in step["by_op"] and "recv" not in step["by_op"], (name, step["by_op"])


def test_hpz_matches_formula(results):
    _assert_close(_measured(results, "hpz_gas4"), hpz_bytes(_inputs(results, "hpz_gas4", 4)), "hpz")


def test_asynchzp_inter_node_bytes_do_not_grow_with_accumulation(results):
    one, four = _measured(results, "asynchzp_gas1"), _measured(results, "asynchzp_gas4")
    assert four["inter_node"] == pytest.approx(one["inter_node"], rel=1e-9)
    # ...while the intra-node micro-step traffic scales with it.
    assert four["intra_node"] > 3.5 * one["intra_node"]


def test_zero3_inter_node_bytes_grow_with_accumulation(results):
    one, four = _measured(results, "zero3_gas1"), _measured(results, "zero3_gas4")
    assert four["inter_node"] == pytest.approx(4 * one["inter_node"], rel=0.01)


def test_asynchzp_crosses_nodes_at_most_a_tenth_of_zero3(results):
    assert _measured(results, "asynchzp_gas4")["inter_node"] <= 0.10 * _measured(results, "zero3_gas4")["inter_node"]
