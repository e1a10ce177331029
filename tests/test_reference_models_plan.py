"""``async_hzp.reference_models``: models without an optimizer (a DPO reference) counted by "auto", the planner
and the layout line, in memory and in their forwards' gathers (`formulas.sizing`, `formulas.traffic`)."""

from __future__ import annotations

import pytest

from ds_asynchzp.config import resolve_layout
from ds_asynchzp.errors import AsyncHZPConfigError
from ds_asynchzp.formulas import sizing, traffic
from ds_asynchzp.planner import arm_formulas, cluster_plan, cli

GIB = 1 << 30


def test_reference_memory_is_the_world_partition_plus_the_copy_over_d_p():
    # b*Psi/N + b*Psi/d_p per model where the engine gets hpZ's copy (1 < d_p < N); stock's b*Psi/N otherwise.
    assert sizing.reference_bytes_per_rank(1600, 16, 4, 1, 2) == 2 * 1600 // 16 + 2 * 1600 // 4
    assert sizing.reference_bytes_per_rank(1600, 16, 4, 3, 2) == 3 * (200 + 800)
    assert sizing.reference_bytes_per_rank(1600, 16, 1, 1, 2) == 200
    assert sizing.reference_bytes_per_rank(1600, 16, 16, 1, 2) == 200
    placed = sizing.placement_bytes_per_rank(1600, 16, 4, 4, 16, offload_optimizer=False, reference_models=1)
    assert placed["device"]["reference_params"] == 1000
    assert placed["device"]["total"] == sizing.placement_bytes_per_rank(
        1600, 16, 4, 4, 16, offload_optimizer=False)["device"]["total"] + 1000
    stock = sizing.stock_placement_bytes_per_rank(1600, 16, offload_optimizer=False, secondary_size=4,
                                                  reference_models=1)["device"]
    assert stock["reference_params"] == 200 + 800 and stock["param_secondary"] == 800
    # hpZ makes its secondary also where the node is the world; AsyncHZP's engine stays stock's there.
    assert sizing.stock_reference_bytes_per_rank(1600, 4, 1, 2, secondary_size=4) == 800 + 800
    # Where the config keeps stock's engine (sequence parallelism, AutoEP, ...), no copy is counted.
    assert sizing.reference_bytes_per_rank(1600, 16, 4, 1, 2, copies=False) == 200


def test_reference_gathers_stay_in_the_node_unless_d_p_is_one():
    t = arm_formulas.traffic_inputs(10**6, 16, 4, 3, "bf16", multiple=16, reference_models=1)
    world_gather = 3 * 2 * t.gathered_elements * 15 / 16
    inside = traffic.asynchzp_flows(t, 4, 4, 16)["reference_gather"]
    assert inside == {"intra_node": pytest.approx(3 * 2 * t.gathered_elements * 3 / 4), "inter_node": 0.0}
    assert traffic.asynchzp_flows(t, 1, 4, 16)["reference_gather"]["inter_node"] == pytest.approx(world_gather)
    no_refs = arm_formulas.traffic_inputs(10**6, 16, 4, 3, "bf16")
    zero3 = traffic.zero3_bytes(arm_formulas.traffic_inputs(10**6, 16, 4, 3, "bf16", reference_models=1))
    assert zero3["inter_node"] - traffic.zero3_bytes(no_refs)["inter_node"] == pytest.approx(world_gather)


def test_auto_counts_reference_models_in_its_choice_and_its_budget():
    # One NIC per node: a reference model's world gathers (d_p = 1) cost the shared NIC, so "auto" moves to d_p = 2.
    kw = dict(nics_per_node=1, grad_accum_steps=4)
    assert sizing.choose_layout(8 * 10**9, 16, 8, 40 * GIB, **kw)[:3] == (1, 2, 8)
    *chosen, reason = sizing.choose_layout(8 * 10**9, 16, 8, 40 * GIB, reference_models=1, **kw)
    assert tuple(chosen) == (2, 2, 8) and "1 reference model(s)" in reason
    # A budget the trained model fits alone but not with its reference: the error names the budget and says why.
    *_, alone = sizing.smallest_memory_layout(8 * 10**9, 16, 8)
    sizing.choose_layout(8 * 10**9, 16, 8, alone)
    with pytest.raises(AsyncHZPConfigError, match="reference model") as err:
        sizing.choose_layout(8 * 10**9, 16, 8, alone, reference_models=1)
    assert "async_hzp.memory_budget_gb" in err.value.keys


def _config(**section):
    return {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
            "async_hzp": {"node_size": 8, "param_shard_size": "auto", "optimizer_shard_size": "auto",
                          "nics_per_node": 1, **section}, "gradient_accumulation_steps": 4,
            "train_micro_batch_size_per_gpu": 1}


def test_the_config_key_reaches_auto_and_the_layout_line():
    with_ref = resolve_layout(_config(reference_models=1, memory_budget_gb=40), 16, 8, has_client_optimizer=True,
                              num_parameters=8 * 10**9)
    without = resolve_layout(_config(memory_budget_gb=40), 16, 8, has_client_optimizer=True,
                             num_parameters=8 * 10**9)
    assert (with_ref.sizes.param_shard_size, without.sizes.param_shard_size) == (2, 1)
    assert "1 reference model(s) counted" in with_ref.describe() and "reference" not in without.describe()
    for bad in (-1, "1", True, 1.5):
        with pytest.raises(AsyncHZPConfigError, match="reference_models") as err:
            resolve_layout(_config(reference_models=bad), 16, 8, num_parameters=10**6)
        assert "async_hzp.reference_models" in err.value.keys


def test_the_planner_counts_them_in_every_arm(capsys):
    base = cluster_plan.plan(8 * 10**9, 16, 8, 4, device_memory=80 * GIB, nics_per_node=1)
    refs = cluster_plan.plan(8 * 10**9, 16, 8, 4, device_memory=80 * GIB, nics_per_node=1, reference_models=1)
    assert refs["inputs"]["reference_models"] == 1 and (refs["layout"]["d_p"], base["layout"]["d_p"]) == (2, 1)
    for arm in ("zero3", "hpz", "asynchzp"):
        assert refs["arms"][arm]["model_state_bytes"]["reference_params"] > 0
    # zero3's reference gathers cross nodes every micro-step; AsyncHZP's (d_p = 2) stay in the node.
    zero3_extra = refs["arms"]["zero3"]["bytes_per_step"]["inter_node"] - base["arms"]["zero3"]["bytes_per_step"]["inter_node"]
    assert zero3_extra == pytest.approx(4 * 2 * 8 * 10**9 * 15 / 16)
    assert refs["arms"]["asynchzp"]["bytes_per_step"]["by_flow"]["reference_gather"]["inter_node"] == 0
    assert cli.main(["--params", "8B", "--world", "16", "--node-size", "8", "--reference-models", "1"]) == 0
    assert "1 reference model(s) of the same size" in capsys.readouterr().out


def test_where_the_config_keeps_stocks_engine_nothing_is_counted_as_a_copy():
    """Under sequence parallelism (and AutoEP, quantized weights, all-reduce fetches) the reference engine stays
    stock's, as `runtime/api.py` builds it: the formulas, "auto" and the layout line say the same."""
    t = arm_formulas.traffic_inputs(10**6, 16, 4, 3, "bf16", multiple=16, reference_models=1, reference_copies=False)
    assert traffic.asynchzp_flows(t, 4, 4, 16)["reference_gather"]["inter_node"] == pytest.approx(
        3 * 2 * t.gathered_elements * 15 / 16)
    sp = resolve_layout(_config(reference_models=1, param_shard_size=2, optimizer_shard_size=16), 16, 8,
                        has_client_optimizer=True, sequence_parallel_size=2)
    assert "as stock: hpZ's secondary partition is not part of DeepSpeed's Ulysses" in sp.describe()
    fetch = _config(reference_models=1, param_shard_size=2, optimizer_shard_size=16)
    fetch["zero_optimization"]["use_all_reduce_for_fetch_params"] = True
    assert "use_all_reduce_for_fetch_params" in resolve_layout(fetch, 16, 8, has_client_optimizer=True).describe()


def test_a_reference_engine_whose_auto_chose_another_d_p_is_warned_of(monkeypatch):
    from ds_asynchzp.resolved_layout import LayoutSizes, ResolvedLayout
    from ds_asynchzp.runtime import api

    monkeypatch.setattr(api, "_FIRST_D_P", {})
    monkeypatch.setattr(api, "_SAID", set())

    def layout(d_p: int, trained: bool) -> ResolvedLayout:
        return ResolvedLayout(LayoutSizes(16, 8, d_p, 8, 16), has_optimizer=trained, auto_reason="auto chose it")

    api._warn_if_auto_differs(layout(4, False))       # TRL builds the reference's engine first
    with pytest.warns(RuntimeWarning, match="d_p=1 for the trained model and d_p=4"):
        api._warn_if_auto_differs(layout(1, True))
    monkeypatch.setattr(api, "_FIRST_D_P", {})
    api._warn_if_auto_differs(layout(2, True))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api._warn_if_auto_differs(layout(2, False))   # the same d_p: nothing to say
