"""Mixture of experts under DeepSpeed's AutoEP: routed experts get their own hierarchical layout inside their
expert-data-parallel group, dense parameters keep theirs.

A tiny random `transformers` Mixtral (4 experts, top-2; `ds_asynchzp.models.mixtral`), AutoEP with ep 2, fp32,
gradient accumulation 2, 6 steps, on 4 ranks in nodes of 2 (each expert-data-parallel group has one rank per
node: experts are replicated inside the node and cross nodes once per step) and on 8 ranks in nodes of 4 (two
members per node: expert parameters sharded over 2 ranks inside the node). Stock ZeRO-3 + AutoEP trains the
same model, data and seed in the same launch.

Gradients are summed in another association than stock (inside the node every micro-step, across nodes once per
step), so losses agree to a relative 1e-6, and parameters, after Adam has normalised the rounding of small
gradients for 6 steps, to 5e-6 (as in test_parity).
"""

import pytest

from ds_asynchzp.formulas.traffic import TrafficInputs, asynchzp_flows
from ds_asynchzp.layout import HierarchicalLayout
from tests.dist_harness import run_cases

STEPS = 6
LOSS_RTOL = 1e-6
PARAM_RTOL = 5e-6
FORMULA_RTOL = 0.01
MOE = {"model": "moe", "autoep_size": 2, "gas": 2, "steps": STEPS}
OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}


def _cases(node_size: int, extra=()) -> list:
    return [dict(MOE, name="zero3"),
            dict(MOE, name="asynchzp", async_hzp={"node_size": node_size}, compare_to="zero3", check_shards=True),
            *extra]


LAUNCHES = {
    (4, 2): _cases(2, [
        # DeepSpeed's default ZeRO-3 knobs (persistent small parameters, prefetch, live parameters, overlap_comm)
        # under another layout: nothing sharded inside the node for parameters, gradients over the node.
        dict(MOE, name="zero3_defaults", default_knobs=True),
        dict(MOE, name="asynchzp_defaults_p1_g2_o4", default_knobs=True, compare_to="zero3_defaults",
             check_shards=True, async_hzp={"node_size": 2, "param_shard_size": 1, "grad_shard_size": 2,
                                           "optimizer_shard_size": 4}),
        # Optimizer states on the host, and a backward after each window's last: the reopened window copies and
        # takes the norms of both families' gradients (the stream model checks that it waits for both sums first).
        dict(MOE, name="zero3_offload_reopened", zero=OFFLOAD, extra_backward=True),
        dict(MOE, name="asynchzp_offload_reopened", zero=OFFLOAD, extra_backward=True, async_hzp={"node_size": 2},
             compare_to="zero3_offload_reopened"),
        # Saved after 3 steps, resumed in a fresh engine: the same run, bit for bit.
        dict(MOE, name="resumed", async_hzp={"node_size": 2}, resume_at=3, compare_to="asynchzp"),
        # A parameter partitioned over a group that is neither the world nor an expert group is refused.
        {"name": "foreign_group", "gas": 1, "steps": 1, "async_hzp": {"node_size": 2},
         "foreign_partition_group": True, "expect_error": True},
    ]),
    (8, 4): _cases(4),
}


@pytest.fixture(scope="module")
def launched_moe(deepspeed_cpu_ops):
    cache = {}

    def get(world, node_size):
        if (world, node_size) not in cache:
            cache[world, node_size] = run_cases(world, node_size, LAUNCHES[world, node_size])
        return cache[world, node_size]

    return get


@pytest.mark.parametrize("world,node_size", sorted(LAUNCHES))
def test_moe_matches_zero3_with_autoep(launched_moe, world, node_size):
    for rank_result in launched_moe(world, node_size):
        result, stock = rank_result["asynchzp"], rank_result["zero3"]
        assert result["optimizer_class"] == "HierarchicalZeroOptimizer"
        assert stock["optimizer_class"] == "DeepSpeedZeroOptimizer_Stage3"
        assert result["max_loss_rel_diff"] <= LOSS_RTOL, (result["losses"], stock["losses"])
        assert result["param_rel_l2_diff"] <= PARAM_RTOL, result["param_rel_l2_diff"]
        assert result["grad_norm"] == pytest.approx(stock["grad_norm"], rel=1e-5)
        assert result["losses"][-1] < result["losses"][0] - 0.3
        # Every fetch built from the shards equals the consolidated weights.
        assert max(result["shard_diffs"]) == 0.0


def test_moe_matches_zero3_under_deepspeeds_default_knobs(launched_moe):
    for rank_result in launched_moe(4, 2):
        result, stock = rank_result["asynchzp_defaults_p1_g2_o4"], rank_result["zero3_defaults"]
        assert result["optimizer_class"] == "HierarchicalZeroOptimizer"
        assert result["max_loss_rel_diff"] <= LOSS_RTOL, (result["losses"], stock["losses"])
        assert result["param_rel_l2_diff"] <= PARAM_RTOL, result["param_rel_l2_diff"]
        assert result["losses"][-1] < result["losses"][0] - 0.3
        assert max(result["shard_diffs"]) == 0.0
        assert result["families"]["dense"]["layout"]["d_p"] == 1


def test_moe_with_offload_and_a_reopened_window_matches_zero3(launched_moe):
    for rank_result in launched_moe(4, 2):
        result, stock = rank_result["asynchzp_offload_reopened"], rank_result["zero3_offload_reopened"]
        assert result["optimizer_class"] == "HierarchicalZeroOptimizer"
        assert result["max_loss_rel_diff"] <= LOSS_RTOL, (result["losses"], stock["losses"])
        assert result["param_rel_l2_diff"] <= PARAM_RTOL, result["param_rel_l2_diff"]
        assert result["grad_norm"] == pytest.approx(stock["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("world,node_size,expert_dp", [(4, 2, 1), (8, 4, 2)])
def test_experts_get_their_own_layout(launched_moe, world, node_size, expert_dp):
    families = launched_moe(world, node_size)[0]["asynchzp"]["families"]
    assert set(families) == {"dense", "expert:ep_size_2"}
    assert families["dense"]["layout"] == {"world": world, "node_size": node_size, "d_p": node_size,
                                           "d_g": node_size, "d_o": world}
    experts = world // 2   # the expert-data-parallel group: one rank of every expert-parallel pair
    assert families["expert:ep_size_2"]["layout"] == {"world": experts, "node_size": node_size // 2,
                                                      "d_p": expert_dp, "d_g": expert_dp, "d_o": experts}


@pytest.mark.parametrize("world,node_size", sorted(LAUNCHES))
def test_expert_traffic_crosses_nodes_once_per_step(launched_moe, world, node_size):
    """The ledger splits dense, expert and token traffic; each flow matches its family's formula, and the
    experts' per-micro-step flows stay inside the node, as the dense ones do."""
    for rank_result in launched_moe(world, node_size):
        result = rank_result["asynchzp"]
        tags = result["steady_per_step"]["by_tag"]
        for family, prefix in (("dense", "asynchzp"), ("expert:ep_size_2", "asynchzp.expert")):
            info = result["families"][family]
            l = info["layout"]
            layout = HierarchicalLayout(l["world"], l["node_size"], l["d_p"], l["d_g"], l["d_o"])
            e = info["elements"]
            t = TrafficInputs(world=layout.world, node_size=layout.node_size, grad_accum=MOE["gas"],
                              gathered_elements=e["gathered"], reduced_elements=e["reduced"],
                              trainable_elements=e["trainable"])
            flows = asynchzp_flows(t, layout.param_shard_size, layout.grad_shard_size, layout.optimizer_shard_size)
            for flow in ("param_gather", "grad_reduce_scatter", "boundary_grad", "param_refresh"):
                measured = tags.get(f"{prefix}.{flow}", {"intra_node": 0.0, "inter_node": 0.0})
                for where in ("intra_node", "inter_node"):
                    assert measured[where] == pytest.approx(flows[flow][where], rel=FORMULA_RTOL, abs=64), \
                        (family, flow, where, measured, flows[flow])
            for flow in ("param_gather", "grad_reduce_scatter"):
                assert flows[flow]["inter_node"] == 0.0
        by_family = result["steady_per_step"]["by_family"]
        assert by_family["tokens"]["intra_node"] > 0 and by_family["tokens"]["inter_node"] == 0.0  # ep inside a node
        assert by_family["expert"]["inter_node"] > 0
        # Stock ZeRO-3 with AutoEP gathers and reduces experts over their whole (cross-node) group every micro-step
        # (A = 2 here: about twice the cross-node expert bytes, growing with A where ours do not).
        stock = rank_result["zero3"]["steady_per_step"]["by_family"]
        assert stock["expert"]["inter_node"] > 1.5 * by_family["expert"]["inter_node"]


def test_moe_resume_is_bit_identical(launched_moe):
    for rank_result in launched_moe(4, 2):
        assert rank_result["resumed"]["bit_identical_losses"], rank_result["resumed"]["losses"]
        assert rank_result["resumed"]["param_rel_l2_diff"] == 0.0


def test_foreign_partition_group_is_refused_by_name(launched_moe):
    for rank_result in launched_moe(4, 2):
        error = rank_result["foreign_group"]["error"]
        assert error is not None and error.startswith("AsyncHZPConfigError"), error
        assert "'extra.weight'" in error and "partitioned over ranks" in error
        assert "neither the data-parallel world" in error and "nor an AutoEP expert group" in error


# ------------------------------------------------------------------ refused from the config, before any collective
def _autoep_config(ep: int, **section) -> dict:
    return {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}, "async_hzp": section,
            "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"}}


def test_autoep_needs_the_world_as_optimizer_group():
    from ds_asynchzp.config import resolve_layout
    from ds_asynchzp.errors import AsyncHZPConfigError

    with pytest.raises(AsyncHZPConfigError, match=r"async_hzp\.optimizer_shard_size.*is 2, fewer than the world"):
        resolve_layout(_autoep_config(2, node_size=2, optimizer_shard_size=2), 4, 2)
    # Unset, it is the world; "auto" picks the world too, whatever the budget would prefer.
    assert resolve_layout(_autoep_config(2, node_size=2), 4, 2).sizes.optimizer_shard_size == 4
    auto = resolve_layout(_autoep_config(2, node_size=2, param_shard_size="auto", optimizer_shard_size="auto",
                                         memory_budget_gb=1000.0), 8, 2, num_parameters=10**6)
    assert auto.sizes.optimizer_shard_size == 8


@pytest.mark.parametrize("world,node,ep,ok", [(8, 4, 2, True), (8, 4, 4, True), (16, 4, 8, True), (12, 4, 6, True),
                                              (12, 4, 3, False), (6, 3, 2, False)])
def test_autoep_size_must_give_every_node_the_same_expert_group_count(world, node, ep, ok):
    from ds_asynchzp.config import resolve_layout
    from ds_asynchzp.errors import AsyncHZPConfigError
    from ds_asynchzp.planner.moe import MoeInputs, check

    config = _autoep_config(ep, node_size=node)
    if ok:
        assert resolve_layout(config, world, node).sizes.world_size == world
        check(MoeInputs(10, ep), 100, world, node)
        return
    with pytest.raises(AsyncHZPConfigError, match=r"expert_parallel\.autoep_size.*different numbers of ranks"):
        resolve_layout(config, world, node)
    with pytest.raises(ValueError, match="must divide the node size"):
        check(MoeInputs(10, ep), 100, world, node)
