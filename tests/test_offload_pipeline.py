"""Optimizer offload's host step in pieces (`async_hzp.offload_pipeline`, `runtime/host_step_pipeline.py`) gives the
bits of the whole step, and stock ZeRO-3's with the same offload where the sums are the same.

Each case trains stock ZeRO-3 with `offload_optimizer: cpu` (DeepSpeedCPUAdam), AsyncHZP with the pipeline, and
AsyncHZP without it, on 4 CPU ranks in 2 nodes of 2, with a fuzzer model whose branch gets no gradient in every
other window. Small boundary chunks and sub-groups make several pieces per sub-group and several sub-groups.
Layouts: d_g = N (the sums in stock's order: bit-identical to stock, also with d_p < d_o and in bf16) and d_p < d_o
with d_g = 2 (another order: fp32 within 1e-6 of stock's losses). In every case the two AsyncHZP arms are
bit-identical, which is what the pipeline must keep. fp32 and bf16, GA 1 and 4, clipping on (binding at 0.05) and
off, DeepSpeed's default sub_group_size and a small one.
"""

from __future__ import annotations

import os

import pytest

from ds_asynchzp.bench.launch import launch_local
from ds_asynchzp.runtime.host_step_pipeline import piece_edges
from tests import fuzz_models
from tests.dist_harness import LAUNCH_TIMEOUT_S, REPO_ROOT

SAME_ORDER = {"param_shard_size": 2, "grad_shard_size": 4, "optimizer_shard_size": 4}
D_P_BELOW_D_O = {"param_shard_size": 1, "grad_shard_size": 2, "optimizer_shard_size": 4}
D_P_BELOW_D_O_SAME_ORDER = {"param_shard_size": 1, "grad_shard_size": 4, "optimizer_shard_size": 4}
MODEL = {"vocab": 32, "dim": 16, "tied": False, "seq_len": 4, "micro_batch": 2,
         "blocks": [{"kind": "mlp", "hidden": 32, "bias": True},
                    {"kind": "branch", "hidden": 32, "bias": True, "when": "step_odd"},
                    {"kind": "mlp", "hidden": 29, "bias": True}]}


def _case(name, layout, gas, clip, bf16=False, zero=None):
    return {"name": name, "seed": 7, "world": 4, "node_size": 2, "layout": layout, "knob_name": "test",
            "zero": dict({"sub_group_size": 1200}, **(zero or {})), "gas": gas, "clip": clip, "steps": 4,
            "async_comm": True, "model": MODEL, "gathered_read_at": 1, "modify_at": None, "lr": 1e-2,
            "weight_decay": 0.01, "offload": True, "bf16": bf16, "boundary_bucket_size": 256,
            "min_piece_elements": 64}


CASES = [_case("same_order_ga4_clip", SAME_ORDER, 4, 1.0),
         _case("same_order_ga1_noclip_default_knobs", SAME_ORDER, 1, 0.0, zero={"sub_group_size": 1_000_000_000}),
         _case("dp_below_do_ga4_clip", D_P_BELOW_D_O, 4, 0.05),
         _case("same_order_dp_below_do_ga1_bf16", D_P_BELOW_D_O_SAME_ORDER, 1, 1.0, bf16=True)]
# Planted: pieces cut at the chunk edges themselves (chunks of 250 columns, not multiples of the vector width), so
# some elements move between DeepSpeedCPUAdam's vector loop and its scalar tail.
PLANTED = [dict(CASES[0], name="planted_unaligned_pieces", plant="unaligned_pieces", boundary_bucket_size=250)]


@pytest.fixture(scope="module")
def results():
    env = {"PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    per_rank = launch_local("tests._offload_pipeline_workers:run_pipeline_cases", 4, 2, {"cases": CASES + PLANTED},
                            timeout_s=LAUNCH_TIMEOUT_S, env=env)
    return per_rank[0]


def test_piece_edges_fall_on_the_vector_width_from_the_sub_group_start():
    assert piece_edges(100, 1000, [300, 310, 700, 1000, 1200], alignment=64) == [292, 676, 1000]
    assert piece_edges(0, 50, [10, 20], alignment=64) == [50]          # no aligned edge inside: one piece


def test_pieces_hold_at_least_the_floor_and_leave_at_least_it_to_the_end():
    ends = list(range(100, 2001, 100))
    assert piece_edges(0, 2000, ends, alignment=1, min_elements=450) == [500, 1000, 1500, 2000]
    assert piece_edges(0, 2000, ends, alignment=1, min_elements=800) == [800, 2000]   # 1600 would leave 400
    assert piece_edges(0, 2000, ends, alignment=1, min_elements=1500) == [2000]


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_the_host_step_in_pieces_gives_the_whole_steps_bits(results, name):
    result = results[name]
    assert result["host_optimizer"] == result["stock_host_optimizer"] == "DeepSpeedCPUAdam"
    # Several pieces per sub-group step, or the case checks nothing the whole step does not.
    assert result["copies"] > 2 * result["sub_group_steps"] > 0, result
    assert result["pipelined_vs_serial"] == [], result


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_the_pipelined_offload_trains_as_stock(results, name):
    result = results[name]
    if name.startswith("same_order"):
        assert result["pipelined_vs_stock"] == [], result
    else:
        # d_g = 2 < N: each rank's gradient is summed inside the node first, then across nodes, another order than
        # stock's sum over the world; within 1e-6 relative.
        assert result["max_loss_rel_diff_vs_stock"] <= 1e-6, result


def test_pieces_cut_off_the_vector_width_are_caught(results):
    """The comparison above fails when the pieces' edges are not aligned: the check can fail, and the alignment
    is what keeps the bits."""
    result = results["planted_unaligned_pieces"]
    assert result["copies"] > 2 * result["sub_group_steps"] > 0, result
    assert result["pipelined_vs_serial"] != [], result
