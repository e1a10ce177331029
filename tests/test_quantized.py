"""Quantized communication (async_hzp.quantized_weights, quantized_gradients, quantize_cross_node): what the
engine sends, that it is deterministic, that its per-rank state survives a checkpoint, and that training on the
shipped text converges like stock ZeRO-3's.

One launch: 4 ranks in 2 nodes of 2, the tiny model, the benchmark's ZeRO-3 knobs (nothing stays gathered), so
every flow of a step runs. Bytes are the ledger's ring-model bytes per rank per steady step, compared with
`ds_asynchzp.formulas.traffic` given the engine's own quantization plan.
"""

import pytest

from ds_asynchzp.formulas.traffic import TrafficInputs, asynchzp_bytes
from ds_asynchzp.config import resolve_layout
from ds_asynchzp.layout import HierarchicalLayout
from ds_asynchzp.quantization import QuantFormat, plan_quantization
from tests.dist_harness import run_cases

WORLD, NODE = 4, 2
STEPS = 6
FORMULA_RTOL = 0.01            # measured bytes vs the formula (the scales and row padding are in the formula)
CONVERGENCE_STEPS = 40
CONVERGENCE_RTOL = 0.02        # final loss of a quantized arm vs stock ZeRO-3's, bf16, on the shipped text
CONVERGENCE_WINDOW = 10        # "final loss": the mean over ranks and over the last 10 steps (one step's is noisy)

CROSS = {"node_size": NODE, "quantize_cross_node": True}
ALL_THREE = {"node_size": NODE, "quantize_cross_node": True, "quantized_weights": True, "error_feedback": True}
FEEDBACK = {"node_size": NODE, "quantized_gradients": True, "error_feedback": True}
INT4_INNER = {"node_size": NODE, "quantized_gradients": True, "gradient_quantization_bits": 4,
              "param_shard_size": 1, "grad_shard_size": 2, "optimizer_shard_size": 2}
_BF16 = {"dtype": "bf16", "gas": 1, "steps": CONVERGENCE_STEPS, "micro_batch": 4, "lr": 1e-3}

CASES = [
    {"name": "asynchzp", "gas": 2, "steps": STEPS, "async_hzp": {"node_size": NODE}},
    {"name": "cross", "gas": 2, "steps": STEPS, "async_hzp": CROSS, "check_padding": True},
    {"name": "int4_inner", "gas": 2, "steps": STEPS, "async_hzp": INT4_INNER, "check_padding": True},
    # Quantization is deterministic: the threads, under a random 0-10 ms delay around every collective, give the
    # synchronous run's losses bit for bit, with every quantized flow and error feedback on.
    {"name": "all_sync", "gas": 2, "steps": STEPS, "async_hzp": dict(ALL_THREE, async_comm=False)},
    {"name": "all_racy", "gas": 2, "steps": STEPS, "async_hzp": ALL_THREE, "comm_delay": "0:10:7",
     "compare_to": "all_sync"},
    # Saved after 3 steps, resumed in a fresh engine: the error-feedback residual comes back with the checkpoint,
    # and only then does the run continue bit for bit (the control forgets it after the load). Gradients only: a
    # quantized refresh leaves quantized copies in the shards, which a fresh engine's first step bypasses for a
    # parameter read outside its module (the model's position table), so that resume is close, not exact.
    {"name": "feedback", "gas": 2, "steps": STEPS, "async_hzp": FEEDBACK},
    {"name": "feedback_resumed", "gas": 2, "steps": STEPS, "async_hzp": FEEDBACK, "resume_at": 3,
     "compare_to": "feedback"},
    {"name": "feedback_resumed_forgetting", "gas": 2, "steps": STEPS, "async_hzp": FEEDBACK, "resume_at": 3,
     "forget_error_feedback": True, "compare_to": "feedback"},
    # Convergence on the shipped text, bf16.
    dict(_BF16, name="zero3_bf16"),
    dict(_BF16, name="cross_bf16", async_hzp=CROSS, compare_to="zero3_bf16"),
    dict(_BF16, name="weights_bf16", async_hzp={"node_size": NODE, "quantized_weights": True},
         compare_to="zero3_bf16"),
]


@pytest.fixture(scope="module")
def results(deepspeed_cpu_ops):
    return run_cases(WORLD, NODE, CASES)


def _measured(results, case):
    return {where: sum(r[case]["steady_per_step"][where] for r in results) / len(results)
            for where in ("intra_node", "inter_node")}


def _predicted(results, case, section, gas=2, param_bytes=4):
    result = results[0][case]
    layout = resolve_layout({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"},
                             "async_hzp": section}, WORLD, NODE)
    elements = result["elements_by_optimizer_group"]
    t = TrafficInputs(world=WORLD, node_size=NODE, grad_accum=gas, gathered_elements=elements["gathered"],
                      reduced_elements=elements["reduced"], trainable_elements=elements["trainable"],
                      param_bytes=param_bytes, grad_comm_bytes=param_bytes)
    sizes = layout.sizes
    return asynchzp_bytes(t, sizes.param_shard_size, sizes.grad_shard_size, sizes.optimizer_shard_size,
                          layout.quantization_plan())


# ------------------------------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize("bits, n, block, expected", [
    (8, 1000, 512, 1000 + 4 * 2), (8, 1001, 512, 1004 + 4 * 2), (4, 1001, 512, 504 + 4 * 2), (4, 2, 2, 4 + 4),
    (8, 0, 512, 0)])
def test_wire_format_sizes(bits, n, block, expected):
    fmt = QuantFormat(bits, block)
    assert fmt.row_bytes(n) == expected
    assert fmt.scales_offset(n) % 4 == 0 and fmt.scales_offset(n) >= fmt.value_bytes(n)
    with pytest.raises(ValueError):
        QuantFormat(3, block)
    with pytest.raises(ValueError):
        QuantFormat(bits, 7)


def test_quantize_cross_node_leaves_flows_inside_a_node_alone():
    # d_p = d_g = node, d_o = world: only the boundary exchange and the refresh cross nodes.
    plan = plan_quantization(HierarchicalLayout(8, 4, 4, 4, 8), quantize_cross_node=True)
    assert (plan.param_gather, plan.grad_reduce_scatter, plan.boundary_allreduce) == (None, None, None)
    assert plan.boundary_grad.bits == 8 and plan.param_refresh.bits == 8
    # d_g spanning both nodes: its per-micro-step reduction crosses nodes, so it is quantized too.
    wide = plan_quantization(HierarchicalLayout(8, 4, 4, 8, 8), quantize_cross_node=True)
    assert wide.grad_reduce_scatter is not None and wide.boundary_grad is None
    # One node: nothing crosses nodes, nothing is quantized; error feedback without an exchange is off.
    assert not plan_quantization(HierarchicalLayout(4, 4, 2, 2, 4), quantize_cross_node=True,
                                 error_feedback=True).any


# ------------------------------------------------------------------------------------------------ engine runs
def test_quantized_cross_node_bytes_match_the_formula_and_halve(results):
    plain, cross = _measured(results, "asynchzp"), _measured(results, "cross")
    predicted = _predicted(results, "cross", CROSS)
    for where in ("intra_node", "inter_node"):
        assert cross[where] == pytest.approx(predicted[where], rel=FORMULA_RTOL), where
    # Intra-node traffic is untouched; fp32 values cross as INT8 plus a scale per 512: about a quarter.
    assert cross["intra_node"] == pytest.approx(plain["intra_node"], rel=1e-9)
    assert cross["inter_node"] <= 0.26 * plain["inter_node"], (cross, plain)


def test_quantized_gradients_int4_bytes_match_the_formula(results):
    measured, predicted = _measured(results, "int4_inner"), _predicted(results, "int4_inner", INT4_INNER)
    for where in ("intra_node", "inter_node"):
        assert measured[where] == pytest.approx(predicted[where], rel=FORMULA_RTOL), where
    for rank_result in results:
        # The quantized reduction is a pairwise exchange, never a point-to-point send.
        ops = {op for step in rank_result["int4_inner"]["ledger_steps"] for op in step["by_op"]}
        assert "all_to_all" in ops and not ops & {"send", "recv"}, ops


def test_shard_padding_stays_zero(results):
    for rank_result in results:
        for case in ("cross", "int4_inner"):
            assert [s["nonzero_padding"] for s in rank_result[case]["ledger_steps"]] == [0] * STEPS, case


def test_quantized_threads_are_bit_identical_to_sync_under_random_delays(results):
    for rank_result in results:
        racy = rank_result["all_racy"]
        assert racy["bit_identical_losses"] and racy["param_rel_l2_diff"] == 0.0, racy["losses"]
        assert racy["error_feedback_norm"] > 0     # the feedback was at work


def test_error_feedback_survives_a_checkpoint(results):
    for rank_result in results:
        resumed, forgetting = rank_result["feedback_resumed"], rank_result["feedback_resumed_forgetting"]
        saved, loaded = resumed["resumed_error_feedback"]
        assert saved > 0 and loaded == saved, (saved, loaded)
        assert resumed["bit_identical_losses"] and resumed["param_rel_l2_diff"] == 0.0, resumed["losses"]
        # Without the residual the same resume drifts off: the saved state is what made it exact.
        assert forgetting["resumed_error_feedback"][1] == 0.0
        assert not forgetting["bit_identical_losses"] and forgetting["param_rel_l2_diff"] > 0


def _final_loss(results, case):
    steps = [sum(r[case]["losses"][s] for r in results) / len(results) for s in range(CONVERGENCE_STEPS)]
    return steps[0], sum(steps[-CONVERGENCE_WINDOW:]) / CONVERGENCE_WINDOW


@pytest.mark.parametrize("case", ["cross_bf16", "weights_bf16"])
def test_quantized_training_converges_like_zero3(results, case):
    first, zero3 = _final_loss(results, "zero3_bf16")
    _, quantized = _final_loss(results, case)
    assert zero3 < 0.7 * first, (first, zero3)          # the run really trained
    assert abs(quantized - zero3) <= CONVERGENCE_RTOL * zero3, (quantized, zero3)


def test_rank_state_of_the_first_format_still_loads(tmp_path):
    """Files of format 1 held the dense family's residual alone; they load into the dense family."""
    from types import SimpleNamespace

    import torch

    from ds_asynchzp.runtime import rank_state
    from ds_asynchzp.state.error_feedback import ErrorFeedback

    layout = resolve_layout({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"},
                             "async_hzp": CROSS}, WORLD, NODE)
    feedback = ErrorFeedback(2, 3, "cpu")
    optimizer = SimpleNamespace(hzp_layout=layout, hzp_error_feedbacks=lambda: {"dense": feedback})
    engine = SimpleNamespace(optimizer=optimizer, global_rank=1)
    saved = torch.arange(6, dtype=torch.float32).view(2, 3)
    torch.save({"format": "ds_asynchzp-rank-state/1", "rank": 1, "layout": rank_state._layout_of(optimizer),
                "error_feedback": {"residual": saved}}, tmp_path / rank_state.file_name(1))
    rank_state.load(engine, str(tmp_path), same_layout=True)
    assert torch.equal(feedback.residual, saved)
    # And the current format round-trips.
    rank_state.save(engine, str(tmp_path / "again"))
    feedback.reset()
    rank_state.load(engine, str(tmp_path / "again"), same_layout=True)
    assert torch.equal(feedback.residual, saved)
