"""``asynchzp-plan`` (ds_asynchzp.planner, ds_asynchzp.planner.cli): unit parsing, the traffic formulas by hand,
the planned numbers against the traffic formulas and the memory model, the "auto" pick, and ``--check`` against a
results.json. No ranks."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from ds_asynchzp.bench import plan_check
from ds_asynchzp.formulas import links, sizing, step_collectives, traffic
from ds_asynchzp.planner import arm_formulas, cluster_plan, inputs
from ds_asynchzp.planner import cli as plan_cli

GIB = 2**30
# The reference example: 70B params, 1024 ranks in nodes of 16, 400 GB/s intra, 200 Gbit/s inter, 64 GB devices.
EXAMPLE = dict(num_params=70 * 10**9, world=1024, node_size=16, dtype="bf16", intra_bw=400e9, inter_bw=25e9,
               device_memory=64 * GIB)


def _plan(grad_accum=8, **changes):
    return cluster_plan.plan(grad_accum=grad_accum, **dict(EXAMPLE, **changes))


def _exit_code(argv) -> int:
    with pytest.raises(SystemExit) as exc:
        plan_cli.main(argv)
    return exc.value.code


# ----------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("text, expected", [
    ("400GB/s", 400e9), ("25GB/s", 25e9), ("200Gbit", 25e9), ("200Gbit/s", 25e9), ("200Gbps", 25e9),
    ("100Gb/s", 12.5e9), ("800 Gbit/s", 100e9), ("1.6Tbit/s", 200e9), ("50GBps", 50e9), ("1GiB/s", 2**30),
    ("100Mbit", 12.5e6), ("2 Bytes/s", 2.0),
])
def test_bandwidth_units_tell_bytes_from_bits(text, expected):
    assert inputs.parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["400", "fast", "400GB/h", "GB/s", "-5GB/s", "0GB/s"])
def test_bad_bandwidths_are_rejected(text):
    with pytest.raises(ValueError):
        inputs.parse_bandwidth(text)


@pytest.mark.parametrize("text, expected", [
    ("80GB", 80 * GIB), ("64GiB", 64 * GIB), ("40000MB", 40000 * 2**20), ("1.5TB", int(1.5 * 2**40)), ("96 G B", None),
])
def test_memory_sizes_are_binary(text, expected):
    if expected is None:
        with pytest.raises(ValueError):
            inputs.parse_memory(text)
    else:
        assert inputs.parse_memory(text) == expected


@pytest.mark.parametrize("text", ["80", "80Gbit", "80GB/s", "eighty GB"])
def test_bad_memory_sizes_are_rejected(text):
    with pytest.raises(ValueError):
        inputs.parse_memory(text)


@pytest.mark.parametrize("text, expected", [
    ("7e9", 7 * 10**9), ("70B", 70 * 10**9), ("70b", 70 * 10**9), ("1.3M", 1_300_000), ("350k", 350_000),
    ("1_000_000", 10**6), ("1T", 10**12), ("123", 123),
])
def test_parameter_counts(text, expected):
    assert inputs.parse_count(text) == expected


@pytest.mark.parametrize("text", ["abc", "0", "70X", "7e9 params", ""])
def test_bad_parameter_counts_are_rejected(text):
    with pytest.raises(ValueError):
        inputs.parse_count(text)


def test_cli_reports_a_bad_unit_as_a_usage_error(capsys):
    assert _exit_code(["--params", "7B", "--world", "8", "--node-size", "4", "--intra-bw", "400",
                       "--inter-bw", "25GB/s"]) == 2
    assert "--intra-bw" in capsys.readouterr().err


def test_model_spec_parameter_count():
    dense = {"layers": 80, "hidden": 8192, "vocab": 32000}
    assert inputs.params_from_model_spec(dense) == 12 * 80 * 8192**2 + 2 * 32000 * 8192
    assert inputs.params_from_model_spec(dict(dense, tied=True)) == 12 * 80 * 8192**2 + 32000 * 8192
    swiglu = dict(dense, ffn_hidden=int(1.5 * 28672))
    assert inputs.params_from_model_spec(swiglu) == 80 * (4 * 8192**2 + 3 * 8192 * 28672) + 2 * 32000 * 8192
    with pytest.raises(ValueError, match="vocab"):
        inputs.params_from_model_spec({"layers": 2, "hidden": 64})
    with pytest.raises(ValueError, match="tied"):
        inputs.params_from_model_spec(dict(dense, tied="false"))


def test_cli_reads_a_model_json(tmp_path, capsys):
    spec = tmp_path / "model.json"
    spec.write_text(json.dumps({"layers": 2, "hidden": 64, "vocab": 256, "tied": True}))
    plan_cli.main(["--model-json", str(spec), "--world", "8", "--node-size", "4", "--intra-bw", "100GB/s",
                   "--inter-bw", "10Gbit", "--device-memory", "16GB", "--json"])
    assert json.loads(capsys.readouterr().out)["inputs"]["params"] == 2 * 12 * 64**2 + 256 * 64


# ------------------------------------------------------------------------------- traffic by hand
# N = 8 ranks in nodes of G = 4, A = 2 micro-steps, b = 2, b_c = 4 (different, so a swapped dtype shows).
SMALL = traffic.TrafficInputs(world=8, node_size=4, grad_accum=2, gathered_elements=1200, reduced_elements=1000,
                              trainable_elements=1100, param_bytes=2, grad_comm_bytes=4, persistent_elements=40)


def test_asynchzp_flows_by_hand_optimizer_inside_the_node():
    """d_p=2, d_g=4, d_o=4: T_p=2, T_g=1, R_o=2. Every flow stays in the node except the replicas' all-reduce
    ({q, q+4}), and there is no boundary exchange (T_g = 1)."""
    got = traffic.asynchzp_bytes(SMALL, 2, 4, 4)
    expected = {
        "param_gather": (2 * 2 * 2 * 1200 * 1 / 2, 0),      # A·2·b·P_g·(d_p-1)/d_p, group {0,1}
        "grad_reduce_scatter": (2 * 4 * 1000 * 3 / 4, 0),   # A·b_c·P_r·(d_g-1)/d_g, group {0..3}
        "boundary_grad": (0, 0),                            # T_g = 1
        "boundary_allreduce": (0, 2 * 4 * 1100 / 4 * 1 / 2),  # 2·b_c·P_t/d_o·(R_o-1)/R_o, {q, q+4}
        "param_refresh": (2 * 1100 / 2 * 1 / 2, 0),         # b·P_t/d_p·(T_p-1)/T_p, {0,2} {1,3} {4,6} {5,7}
        "persistent_regather": (2 * 40 * 1 / 2, 0),         # b·P_persist·(d_p-1)/d_p
    }
    for flow, (intra, inter) in expected.items():
        assert got["by_flow"][flow] == {"intra_node": pytest.approx(intra), "inter_node": pytest.approx(inter)}, flow
    assert got["intra_node"] == pytest.approx(4800 + 6000 + 550 + 40)
    assert got["inter_node"] == pytest.approx(1100)
    # gloo's ring all-reduce over {q, q+4}: both ring edges cross, so every byte of it is on a link.
    assert step_collectives.link_bytes("asynchzp", SMALL, 2, 4, 4) == pytest.approx(1100)


def test_asynchzp_flows_by_hand_optimizer_over_the_world():
    """d_p=2, d_g=4, d_o=8: T_p=4, T_g=2, R_o=1. The boundary exchange ({i, i+4}) and the refresh
    ({j, j+2, j+4, j+6}) cross nodes; no all-reduce."""
    got = traffic.asynchzp_bytes(SMALL, 2, 4, 8)
    flows = got["by_flow"]
    assert flows["boundary_grad"] == {"intra_node": 0, "inter_node": pytest.approx(4 * 1100 / 4 * 1 / 2)}
    assert flows["boundary_allreduce"] == {"intra_node": 0, "inter_node": 0}
    assert flows["param_refresh"] == {"intra_node": 0, "inter_node": pytest.approx(2 * 1100 / 2 * 3 / 4)}
    assert got["intra_node"] == pytest.approx(4800 + 6000 + 40)
    assert got["inter_node"] == pytest.approx(550 + 825)
    # Links: the pairwise exchange sends S/T_g = 550 to the one member on the other node; the refresh ring
    # 0-2-4-6 has 2 of 4 edges between nodes, so half its 825 bytes go over a link.
    assert step_collectives.link_bytes("asynchzp", SMALL, 2, 4, 8) == pytest.approx(550 + 825 / 2)
    # An arm name with overrides is the same formula.
    assert step_collectives.link_bytes("asynchzp:optimizer_shard_size=8", SMALL, 2, 4, 8) == pytest.approx(962.5)


def test_asynchzp_grad_group_spanning_nodes_and_defaults():
    """d_g = 8 spans both nodes: the per-micro-step reduce-scatter is inter-node, and gloo runs it as an
    all-reduce (two passes) of which 2 of 8 ring edges cross nodes."""
    got = traffic.asynchzp_bytes(SMALL, 2, 8, 8)
    assert got["by_flow"]["grad_reduce_scatter"] == {"intra_node": 0, "inter_node": pytest.approx(2 * 4 * 1000 * 7 / 8)}
    assert step_collectives.link_bytes("asynchzp", SMALL, 2, 8, 8) == pytest.approx(2 * 7000 * 2 / 8 + 825 / 2)
    # d_o defaults to the world; one node has no inter-node flow at all.
    assert traffic.asynchzp_bytes(SMALL, 2, 4) == traffic.asynchzp_bytes(SMALL, 2, 4, 8)
    one_node = dataclasses.replace(SMALL, node_size=8)
    assert traffic.asynchzp_bytes(one_node, 2, 4, 8)["inter_node"] == 0
    assert step_collectives.link_bytes("asynchzp", one_node, 2, 4, 8) == 0
    with pytest.raises(ValueError, match="invalid layout"):
        traffic.asynchzp_bytes(SMALL, 4, 2, 8)


def test_optimizer_groups_not_aligned_with_nodes_split_by_rank_share():
    """N=12 in nodes of 4 with d_o=3: of the blocks {0,1,2} {3,4,5} {6,7,8} {9,10,11}, the middle two span
    nodes, so half of the boundary exchange's bytes count as inter-node."""
    t = traffic.TrafficInputs(world=12, node_size=4, grad_accum=1, gathered_elements=300, reduced_elements=300,
                              trainable_elements=300, param_bytes=2, grad_comm_bytes=2)
    flow = traffic.asynchzp_bytes(t, 1, 1, 3)["by_flow"]["boundary_grad"]
    assert flow["intra_node"] == pytest.approx(flow["inter_node"]) == pytest.approx(2 * 300 * 2 / 3 / 2)


def test_no_point_to_point_flows_remain():
    assert set(traffic.asynchzp_bytes(SMALL, 2, 4, 8)["by_flow"]) == {
        "param_gather", "grad_reduce_scatter", "boundary_grad", "boundary_allreduce", "param_refresh",
        "persistent_regather", "reference_gather"}
    assert not hasattr(traffic, "permutation_fractions")


# ------------------------------------------------------------------------------------ planned traffic
def test_asynchzp_crosses_nodes_far_less_than_zero3_whatever_the_accumulation():
    plans = {gas: _plan(grad_accum=gas, param_shard_size=16, optimizer_shard_size=1024) for gas in (1, 8, 32)}
    inter = {gas: {arm: p["arms"][arm]["bytes_per_step"]["inter_node"] for arm in arm_formulas.ARMS}
             for gas, p in plans.items()}
    assert inter[1]["asynchzp"] == inter[8]["asynchzp"] == inter[32]["asynchzp"]
    assert inter[32]["zero3"] == pytest.approx(32 * inter[1]["zero3"])
    assert inter[8]["asynchzp"] < 0.01 * inter[8]["zero3"]
    # (b_c + b)·Ψ/G·(1 - G/N) (docs/ARCHITECTURE.md), against ZeRO-3's A·(2b + b_c)·Ψ·(N-1)/N.
    assert inter[8]["asynchzp"] == pytest.approx(4 * 70e9 / 16 * (1 - 16 / 1024))
    layout = plans[8]["layout"]
    assert (layout["d_p"], layout["d_g"], layout["d_o"], layout["source"]) == (16, 16, 1024, "given")
    times = plans[8]["arms"]["asynchzp"]["comm_time_s"]
    load = plans[8]["arms"]["asynchzp"]["links"]
    assert times["nic"] == pytest.approx(load["nic_busiest"] / 25e9)
    assert times["fabric"] == pytest.approx(load["fabric_busiest"] / 400e9)
    assert times["total"] >= max(times["nic"], times["fabric"])


def test_zeropp_published_quarter_and_what_stock_qgz_sends():
    """The paper's accounting (0.5M + 0 + 0.25M against 3M per micro-step) and what stock DeepSpeed sends: its qgZ
    crosses nodes with the node-reduced slice only, 1/G of the INT4 gradient, so less than the paper counts."""
    from ds_asynchzp.formulas import traffic
    from ds_asynchzp.planner import volume

    t = traffic.TrafficInputs(world=64, node_size=8, grad_accum=1, gathered_elements=6400, reduced_elements=6400,
                              trainable_elements=6400, param_bytes=2, grad_comm_bytes=2)
    published = sum(volume.published_flows("zeropp", t).values())
    zero3 = sum(volume.published_flows("zero3", t).values())
    assert published / zero3 == pytest.approx(0.25)
    sent = volume.zeropp_flows(t)
    assert sent["gradient reduction"] == pytest.approx(0.5 * 6400 / 8 * (8 - 1) / 8)
    one = _plan(grad_accum=1)["arms"]
    ratio = one["zeropp"]["bytes_per_step"]["inter_node"] / one["zero3"]["bytes_per_step"]["inter_node"]
    assert 1 / 6 < ratio < 0.25  # the INT8 forward gather (1/6 of 3M) plus a little gradient
    # hpZ's world gather happens once per step, so with accumulation the share falls further.
    eight = _plan(grad_accum=8)["arms"]
    ratio8 = eight["zeropp"]["bytes_per_step"]["inter_node"] / eight["zero3"]["bytes_per_step"]["inter_node"]
    assert ratio8 < ratio / 4


def test_quantized_asynchzp_shrinks_only_the_cross_node_traffic():
    # asynchzp-q is the engine's quantize_cross_node: the once-per-step gradient exchange and parameter refresh
    # cross nodes as INT8 blocks (1 byte a value plus a 4-byte scale per 512 values) instead of bf16; every
    # intra-node flow is unchanged.
    plan = _plan(param_shard_size=16, grad_shard_size=16)
    arms = plan["arms"]
    assert (plan["layout"]["d_p"], plan["layout"]["d_g"]) == (16, 16)
    plain, quantized = arms["asynchzp"]["bytes_per_step"], arms["asynchzp-q"]["bytes_per_step"]
    assert quantized["intra_node"] == pytest.approx(plain["intra_node"])
    per_value = (1 + 4 / 512) / 2
    for flow in ("boundary_grad", "param_refresh"):
        assert quantized["by_flow"][flow]["inter_node"] == pytest.approx(plain["by_flow"][flow]["inter_node"] * per_value)
        assert plain["by_flow"][flow]["inter_node"] > 0
    for flow in ("param_gather", "grad_reduce_scatter"):
        assert quantized["by_flow"][flow] == plain["by_flow"][flow]
    assert quantized["inter_node"] == pytest.approx(plain["inter_node"] * per_value)


def test_quantized_flows_follow_the_engine_plan():
    # quantize_cross_node leaves flows inside a node alone; quantized_gradients quantizes them everywhere.
    t = arm_formulas.traffic_inputs(10**6, 8, 4, 2, "bf16")
    cross = arm_formulas.arm_quantization("asynchzp-q", 8, 4, 2, 2, 4)       # d_o = 4 = node: boundary inside a node
    assert cross.boundary_grad is None and cross.param_refresh is None and cross.boundary_allreduce is not None
    every = arm_formulas.arm_quantization("asynchzp-qg", 8, 4, 2, 2, 4, {"gradient_quantization_bits": 4})
    assert every.grad_reduce_scatter.bits == every.boundary_grad.bits == every.boundary_allreduce.bits == 4
    plain = traffic.asynchzp_bytes(t, 2, 2, 4)["by_flow"]
    quant = traffic.asynchzp_bytes(t, 2, 2, 4, every)["by_flow"]
    assert quant["grad_reduce_scatter"]["intra_node"] == pytest.approx(
        plain["grad_reduce_scatter"]["intra_node"] * (0.5 + 4 / 512) / 2)
    assert quant["param_gather"] == plain["param_gather"]


def test_arms_reuse_the_traffic_module():
    plan = _plan()
    d_p, d_g, d_o = (plan["layout"][k] for k in ("d_p", "d_g", "d_o"))
    t = arm_formulas.traffic_inputs(70 * 10**9, 1024, 16, 8, "bf16")
    arms = plan["arms"]
    assert arms["zero3"]["bytes_per_step"] == traffic.zero3_bytes(t)
    assert arms["hpz"]["bytes_per_step"] == traffic.hpz_bytes(t)
    t_o = arm_formulas.traffic_inputs(70 * 10**9, 1024, 16, 8, "bf16", multiple=d_o)
    assert arms["asynchzp"]["bytes_per_step"] == traffic.asynchzp_bytes(t_o, d_p, d_g, d_o)
    # The link figures place the same collectives on the links (formulas.links, one NIC per rank, NCCL).
    topology = links.Topology(1024, 16)
    assert arms["zero3"]["links"] == links.link_load(step_collectives.zero3(t), topology).summary()
    assert arms["asynchzp"]["links"] == links.link_load(step_collectives.asynchzp(t_o, d_p, d_g, d_o),
                                                        topology).summary()


def test_asynchzp_arm_pads_to_the_optimizer_group():
    # 1000 elements over 64 ranks pad to 1024, over an optimizer group of 8 to 1000.
    plan = cluster_plan.plan(1000, 64, 8, param_shard_size=8, grad_shard_size=8, optimizer_shard_size=8,
                             memory_budget=GIB, intra_bw=1e9, inter_bw=1e9)
    assert plan["arms"]["zero3"]["model_state_bytes"]["param_shard"] == 2 * 1024 // 64
    assert plan["arms"]["asynchzp"]["model_state_bytes"] == sizing.model_state_bytes_per_rank(1000, 64, 8, 8, 8)


# ----------------------------------------------------------------------------------- memory and auto
@pytest.mark.parametrize("case", [
    dict(), dict(device_memory=120 * GIB), dict(num_params=7 * 10**9, world=64, node_size=8, device_memory=80 * GIB),
    dict(num_params=13 * 10**9 + 7, world=48, node_size=8, dtype="fp32", device_memory=80 * GIB),
    dict(grad_accum=1, inter_bw=400e9),
])
def test_auto_is_what_choose_layout_picks(case):
    result = _plan(**case)
    inp = result["inputs"]
    budget = inp["device_memory_bytes"] * sizing.DEFAULT_BUDGET_FRACTION
    *expected, reason = sizing.choose_layout(
        inp["padded_params"], inp["world"], inp["node_size"], budget, param_bytes=inp["param_bytes"],
        grad_accum_bytes=inp["grad_accum_bytes"], grad_comm_bytes=inp["grad_comm_bytes"],
        grad_accum_steps=inp["grad_accum"], intra_bw_bytes_s=inp["intra_bw_bytes_per_s"],
        inter_bw_bytes_s=inp["inter_bw_bytes_per_s"])
    assert [result["auto"][k] for k in ("d_p", "d_g", "d_o")] == expected
    assert result["auto"]["reason"] == reason
    assert [result["layout"][k] for k in ("d_p", "d_g", "d_o")] == expected and result["layout"]["source"] == "auto"


def test_auto_with_fixed_sizes_constrains_the_search():
    result = _plan(param_shard_size=8, grad_shard_size="auto", optimizer_shard_size="auto")
    layout = result["layout"]
    assert layout["d_p"] == 8 and layout["source"] == "auto with param_shard_size=8"
    assert "d_p=8" in layout["reason"] and "of 36 valid layouts" in layout["reason"]
    # The unconstrained pick is still reported.
    assert result["auto"] == _plan()["auto"]


def test_explicit_budget_and_no_fit():
    # 200 GiB fits replicating far more: the pick moves away from d_p = 16 and still fits.
    roomy = _plan(memory_budget=200 * GIB)
    assert roomy["auto"]["error"] is None and roomy["auto"]["d_p"] < 16
    assert roomy["arms"]["asynchzp"]["model_state_bytes"]["total"] <= 200 * GIB
    tight = _plan(device_memory=8 * GIB)
    assert tight["auto"]["d_p"] is None and "memory_budget_gb" in tight["auto"]["error"]
    # Planned with the smallest-memory layout, which the memory columns flag.
    assert (tight["layout"]["d_p"], tight["layout"]["d_g"], tight["layout"]["d_o"]) == (16, 1024, 1024)
    assert tight["arms"]["asynchzp"]["fits_device_memory"] is False
    assert tight["arms"]["zero3"]["fits_device_memory"] is True


def test_memory_is_the_sizing_model():
    psi, world, node, b = 70 * 10**9, 1024, 16, 2
    arms = _plan(param_shard_size=16, optimizer_shard_size=1024)["arms"]
    assert arms["asynchzp"]["model_state_bytes"] == sizing.model_state_bytes_per_rank(psi, world, 16, 16, world, b, b)
    assert arms["asynchzp-q"]["model_state_bytes"] == arms["asynchzp"]["model_state_bytes"]
    zero3 = sizing.model_state_bytes_per_rank(psi, world, world, world, world, b, b)
    assert arms["zero3"]["model_state_bytes"] == zero3 and zero3["total"] == 16 * psi // world
    assert arms["hpz"]["model_state_bytes"]["total"] == zero3["total"] + b * psi // node
    assert arms["zeropp"]["model_state_bytes"] == arms["hpz"]["model_state_bytes"]
    # fp32 gradient accumulation doubles the gradient shard only.
    fp32_accum = _plan(param_shard_size=16, optimizer_shard_size=1024, grad_accum_dtype="fp32")["arms"]["asynchzp"]
    assert fp32_accum["model_state_bytes"]["grad_shard"] == 2 * arms["asynchzp"]["model_state_bytes"]["grad_shard"]


def test_explicit_sizes_go_through_the_engine_layout_check(capsys):
    assert _plan(param_shard_size=8, grad_shard_size=16, optimizer_shard_size=1024)["layout"]["source"] == "given"
    assert _plan(param_shard_size=8, grad_shard_size=16, optimizer_shard_size=64)["layout"]["d_o"] == 64
    base = ["--params", "70B", "--world", "1024", "--node-size", "16", "--intra-bw", "400GB/s",
            "--inter-bw", "200Gbit", "--device-memory", "64GB"]
    assert _exit_code([*base, "--param-shard-size", "3"]) == 2
    assert "param_shard_size" in capsys.readouterr().err
    assert _exit_code([*base, "--param-shard-size", "3", "--grad-shard-size", "auto"]) == 2
    assert "param_shard_size" in capsys.readouterr().err
    assert _exit_code([*base, "--optimizer-shard-size", "24"]) == 2
    assert "optimizer_shard_size" in capsys.readouterr().err
    assert _exit_code([*base, "--param-shard-size", "16", "--grad-shard-size", "32", "--optimizer-shard-size",
                       "16"]) == 2
    assert "optimizer_shard_size" in capsys.readouterr().err
    assert _exit_code(["--params", "70B"]) == 2
    assert "--world" in capsys.readouterr().err


def test_json_output_parses_and_the_table_lists_every_arm(capsys):
    argv = ["--params", "70B", "--world", "1024", "--node-size", "16", "--intra-bw", "400GB/s", "--inter-bw",
            "200Gbit", "--grad-accum", "8", "--device-memory", "64GB"]
    assert plan_cli.main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["arms"]) == set(arm_formulas.ARMS)
    auto = data["auto"]
    assert data["inputs"]["inter_bw_bytes_per_s"] == 25e9 and data["inputs"]["device_memory_bytes"] == 64 * GIB
    assert plan_cli.main(argv) == 0
    table = capsys.readouterr().out
    pick = f"d_p={auto['d_p']} d_g={auto['d_g']} d_o={auto['d_o']}"
    assert f'"auto" would choose {pick}' in table and auto["reason"] in table
    assert "valid layouts" in auto["reason"] and "s per optimizer step" in auto["reason"]
    assert f"asynchzp arms use {pick} (auto)" in table
    assert all(f"\n{arm} " in table for arm in arm_formulas.ARMS)


# ------------------------------------------------------------------------------------------ --check
BENCH_CONFIG = {"nproc": 8, "world_size": 8, "node_size": 4, "grad_accum": 4, "dtype": "fp32", "model": "tiny",
                "moe_experts": 0, "seq_len": 64, "arm_overrides": {"asynchzp": {"async_hzp": {"node_size": 4}}}}
O4_ARM = "asynchzp:param_shard_size=2:grad_shard_size=4:optimizer_shard_size=4"
O4_LAYOUT = {"world_size": 8, "node_size": 4, "num_nodes": 2, "param_shard_size": 2, "grad_shard_size": 4,
             "optimizer_shard_size": 4, "auto_reason": None}


def _inputs(elements: dict) -> traffic.TrafficInputs:
    return traffic.TrafficInputs(world=8, node_size=4, grad_accum=4, gathered_elements=elements["gathered"],
                                 reduced_elements=elements["reduced"], trainable_elements=elements["trainable"])


def _synthetic_results(elements: dict, with_elements: bool, o4_elements: dict | None = None) -> dict:
    """zero3, hpz, asynchzp (no layout recorded: the defaults) and an overridden asynchzp arm with d_o = 4,
    whose elements are padded to 4 (``o4_elements``; recorded in its entry when ``with_elements``)."""
    t = _inputs(elements)
    o4_elements = o4_elements or elements
    arms = {"zero3": traffic.zero3_bytes(t), "hpz": traffic.hpz_bytes(t), "asynchzp": traffic.asynchzp_bytes(t, 4, 4),
            O4_ARM: traffic.asynchzp_bytes(_inputs(o4_elements), 2, 4, 4)}
    config = copy.deepcopy(BENCH_CONFIG)
    config["arm_overrides"][O4_ARM] = {"async_hzp": {"node_size": 4, "param_shard_size": 2, "grad_shard_size": 4,
                                                     "optimizer_shard_size": 4}}
    results = {"config": config,
               "arms": {arm: {"bytes_per_step": {k: b[k] for k in ("intra_node", "inter_node")}}
                        for arm, b in arms.items()}}
    results["arms"][O4_ARM]["layout"] = dict(O4_LAYOUT)
    results["arms"]["mystery"] = {"bytes_per_step": {"intra_node": 1.0, "inter_node": 1.0}}
    if with_elements:
        results["config"]["elements"] = dict(elements)
        results["arms"][O4_ARM]["elements"] = dict(o4_elements)
    return results


def _check(tmp_path, results, capsys) -> tuple[int, str]:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    code = plan_cli.main(["--check", str(path)])
    return code, capsys.readouterr().out


def test_bench_element_counts_match_the_ledger_tests():
    from ds_asynchzp.models.gpt import build_model
    from tests._dist_workers import _element_counts

    counts = plan_check.bench_element_counts(BENCH_CONFIG)
    expected = _element_counts(build_model("tiny"), 8)
    qgz = counts.pop("qgz")
    assert counts == {k: expected[k] for k in ("gathered", "reduced", "trainable")}
    # qgZ's share: the 2-D gradients that split into 2N parts, never more than what is reduced.
    assert qgz == sum(p.numel() for n, p in build_model("tiny").named_parameters()
                      if p.requires_grad and n != "unused" and p.dim() == 2 and p.numel() % 16 == 0)
    assert 0 < qgz < counts["reduced"]
    assert counts["gathered"] > counts["trainable"] > counts["reduced"]  # tied weight twice; unused param
    by_group = plan_check.bench_element_counts(BENCH_CONFIG, 4)
    by_group.pop("qgz")
    expected = _element_counts(build_model("tiny"), 4)
    assert by_group == {k: expected[k] for k in ("gathered", "reduced", "trainable")}
    assert all(by_group[k] <= counts[k] for k in counts)


@pytest.mark.parametrize("with_elements", [True, False])
def test_check_passes_on_formula_bytes_and_fails_ten_percent_off(tmp_path, capsys, with_elements):
    if with_elements:
        elements = {"gathered": 123_456, "reduced": 100_000, "trainable": 101_000}
        o4 = {"gathered": 123_452, "reduced": 99_996, "trainable": 100_996}
    else:
        elements, o4 = plan_check.bench_element_counts(BENCH_CONFIG), plan_check.bench_element_counts(BENCH_CONFIG, 4)
    results = _synthetic_results(elements, with_elements, o4)
    code, out = _check(tmp_path, results, capsys)
    assert code == 0, out
    assert "PASS" in out and "'mystery'" in out
    assert f"{O4_ARM}: d_p=2 d_g=4 d_o=4" in out and "asynchzp: d_p=4 d_g=4 d_o=8" in out
    report = plan_check.check_results(results)
    assert report["asynchzp_layouts"] == {"asynchzp": {"d_p": 4, "d_g": 4, "d_o": 8},
                                          O4_ARM: {"d_p": 2, "d_g": 4, "d_o": 4}}
    assert {r["arm"] for r in report["rows"]} == {"zero3", "hpz", "asynchzp", O4_ARM}
    for arm in ("asynchzp", O4_ARM):
        off = copy.deepcopy(results)
        off["arms"][arm]["bytes_per_step"]["inter_node"] *= 1.10
        code, out = _check(tmp_path, off, capsys)
        assert code == 1 and "MISMATCH" in out and "FAIL" in out
    # Within the 5 % tolerance still passes.
    near = copy.deepcopy(results)
    near["arms"][O4_ARM]["bytes_per_step"]["intra_node"] *= 1.04
    assert _check(tmp_path, near, capsys)[0] == 0


def test_check_knows_the_offload_arms(tmp_path, capsys):
    """zero3-offload moves zero3's network bytes and asynchzp-offload asynchzp's (offload changes no collective):
    both are checked against those formulas, each with its own layout, and a 10 % error is caught."""
    elements = {"gathered": 123_456, "reduced": 100_000, "trainable": 101_000}
    results = _synthetic_results(elements, with_elements=True)
    t = _inputs(elements)
    results["arms"]["zero3-offload"] = copy.deepcopy(results["arms"]["zero3"])
    results["arms"]["asynchzp-offload:param_shard_size=2"] = {
        "bytes_per_step": {k: v for k, v in traffic.asynchzp_bytes(t, 2, 4).items() if k != "by_flow"},
        "layout": {"param_shard_size": 2, "grad_shard_size": 4, "optimizer_shard_size": 8}}
    code, out = _check(tmp_path, results, capsys)
    assert code == 0, out
    report = plan_check.check_results(results)
    assert not any("offload" in note for note in report["notes"])
    assert {"zero3-offload", "asynchzp-offload:param_shard_size=2"} <= {r["arm"] for r in report["rows"]}
    assert report["asynchzp_layouts"]["asynchzp-offload:param_shard_size=2"] == {"d_p": 2, "d_g": 4, "d_o": 8}
    for arm in ("zero3-offload", "asynchzp-offload:param_shard_size=2"):
        off = copy.deepcopy(results)
        off["arms"][arm]["bytes_per_step"]["inter_node"] *= 1.10
        assert not plan_check.check_results(off)["ok"]


def test_check_reads_each_asynchzp_arm_layout():
    results = _synthetic_results({"gathered": 1000, "reduced": 800, "trainable": 900}, with_elements=True)
    # Recorded layout first; then the arm's integer overrides; then d_p = d_g = node size, d_o = world.
    assert plan_check.asynchzp_sizes(results, O4_ARM, 4, 8) == (2, 4, 4)
    del results["arms"][O4_ARM]["layout"]
    assert plan_check.asynchzp_sizes(results, O4_ARM, 4, 8) == (2, 4, 4)
    del results["config"]["arm_overrides"][O4_ARM]
    assert plan_check.asynchzp_sizes(results, O4_ARM, 4, 8) == (4, 4, 8)
    results["config"]["arm_overrides"]["asynchzp:optimizer_shard_size=auto"] = {
        "async_hzp": {"optimizer_shard_size": "auto"}}
    with pytest.raises(ValueError, match="auto"):
        plan_check.asynchzp_sizes(results, "asynchzp:optimizer_shard_size=auto", 4, 8)
    # An "auto" arm whose entry records the resolved layout is fine.
    results["arms"]["asynchzp:optimizer_shard_size=auto"] = {"layout": {"param_shard_size": 4, "grad_shard_size": 4,
                                                                        "optimizer_shard_size": 4}}
    assert plan_check.asynchzp_sizes(results, "asynchzp:optimizer_shard_size=auto", 4, 8) == (4, 4, 4)


def test_check_zero_prediction_and_wire_bytes(tmp_path, capsys):
    elements = {"gathered": 123_456, "reduced": 100_000, "trainable": 101_000}
    results = _synthetic_results(elements, with_elements=True)
    zero3 = results["arms"]["zero3"]
    zero3["bytes_per_step"]["intra_node"] = 512  # a few scalars on a figure predicted to be 0
    # Node links carry only the ring edges between nodes: step_collectives.link_bytes, plus frame and ACK overhead
    # (no network section in the config: MTU 1500 on veth).
    t = traffic.TrafficInputs(world=results["config"]["nproc"], node_size=results["config"]["node_size"],
                                      grad_accum=results["config"]["grad_accum"], gathered_elements=123_456,
                                      reduced_elements=100_000, trainable_elements=101_000, param_bytes=4,
                                      grad_comm_bytes=4)
    link = step_collectives.link_bytes("zero3", t)
    assert link < zero3["bytes_per_step"]["inter_node"]
    zero3["wire_bytes_inter_node_per_step"] = link * plan_check.WIRE_OVERHEAD_FACTOR
    zero3["link_bytes_inter_node_per_step"] = link
    # The overridden asynchzp arm's link bytes, with its own layout.
    o4 = results["arms"][O4_ARM]
    o4["link_bytes_inter_node_per_step"] = step_collectives.link_bytes(O4_ARM, t, 2, 4, 4)
    assert _check(tmp_path, results, capsys)[0] == 0
    report = plan_check.check_results(results)
    assert any(r["quantity"] == "inter_node_wire" and r["ok"] for r in report["rows"])
    assert any(r["arm"] == O4_ARM and r["quantity"] == "inter_node_link" and r["ok"] for r in report["rows"])
    o4["link_bytes_inter_node_per_step"] *= 1.10
    assert _check(tmp_path, results, capsys)[0] == 1
    o4["link_bytes_inter_node_per_step"] /= 1.10
    zero3["wire_bytes_inter_node_per_step"] *= 1.10
    assert _check(tmp_path, results, capsys)[0] == 1
    zero3["wire_bytes_inter_node_per_step"] /= 1.10
    zero3["bytes_per_step"]["intra_node"] = 4096
    assert _check(tmp_path, results, capsys)[0] == 1


@pytest.mark.parametrize("topology", ["shared", "rails"])
def test_check_compares_every_links_counter_with_the_model(topology, tmp_path, capsys):
    """Link by link: each link's counter (headers off) against `formulas.links` with gloo's rings on the run's
    topology. On rails zero3's world rings cross nodes into local index 0 only, so rail 0 carries them and the other
    rails nothing; a link 10 % off fails, as does a link the model leaves idle carrying a ring's worth."""
    elements = {"gathered": 123_456, "reduced": 100_000, "trainable": 101_000}
    results = _synthetic_results(elements, with_elements=True)
    results["config"]["network"] = {"mode": "emulated", "topology": topology, "mtu": 1500}
    t = traffic.TrafficInputs(world=8, node_size=4, grad_accum=4, gathered_elements=123_456, reduced_elements=100_000,
                              trainable_elements=101_000, param_bytes=4, grad_comm_bytes=4)
    factor = plan_check.wire_overhead_factor(1500)
    predicted = plan_check.link_loads(results["config"], "zero3", t, None, None, None, None)
    assert sorted(predicted) == ([f"node{n}/eth0" for n in range(2)] if topology == "shared" else
                                 [f"node{n}/eth{i}" for n in range(2) for i in range(4)])
    if topology == "rails":
        assert predicted["node0/eth0"] > 0 and predicted["node0/eth3"] == 0
    else:
        assert sum(predicted.values()) == pytest.approx(8 * step_collectives.link_bytes("zero3", t))
    zero3 = results["arms"]["zero3"]
    zero3["wire_bytes_by_link_per_step"] = {name: v * factor for name, v in predicted.items()}
    report = plan_check.check_results(results)
    rows = [r for r in report["rows"] if r["arm"] == "zero3" and r["quantity"].startswith("link ")]
    assert len(rows) == len(predicted) and all(r["ok"] for r in rows)
    assert report["inputs"]["topology"] == topology
    assert _check(tmp_path, results, capsys)[0] == 0
    zero3["wire_bytes_by_link_per_step"]["node1/eth0"] *= 1.10
    assert _check(tmp_path, results, capsys)[0] == 1
    zero3["wire_bytes_by_link_per_step"]["node1/eth0"] /= 1.10
    if topology == "rails":   # a rail the model leaves idle carrying rail 0's bytes: the sender's rail, planted
        zero3["wire_bytes_by_link_per_step"]["node0/eth3"] = predicted["node0/eth0"] * factor
        assert _check(tmp_path, results, capsys)[0] == 1



def test_check_takes_each_counted_frames_headers_off():
    """Where the run counted frames, a link's payload is its bytes less 66 B per frame (Ethernet, IPv4, TCP with
    timestamps; acknowledgements are headers only): exact for small messages, whose partial frames a full-frame
    factor misses. The same counters read with the factor, as older records are, come out 10 % high."""
    elements = {"gathered": 123_456, "reduced": 100_000, "trainable": 101_000}
    results = _synthetic_results(elements, with_elements=True)
    results["config"]["network"] = {"mode": "emulated", "topology": "shared", "mtu": 1500}
    t = traffic.TrafficInputs(world=8, node_size=4, grad_accum=4, gathered_elements=123_456, reduced_elements=100_000,
                              trainable_elements=101_000, param_bytes=4, grad_comm_bytes=4)
    predicted = plan_check.link_loads(results["config"], "zero3", t, None, None, None, None)
    # Messages of 200 B payload, one frame each, and an acknowledgement for every second one.
    frames = {name: v / 200 * 1.5 for name, v in predicted.items()}
    zero3 = results["arms"]["zero3"]
    zero3["wire_bytes_by_link_per_step"] = {name: v + frames[name] * 66 for name, v in predicted.items()}
    zero3["wire_packets_by_link_per_step"] = frames
    report = plan_check.check_results(results)
    rows = [r for r in report["rows"] if r["arm"] == "zero3" and r["quantity"].startswith(("link ", "inter_node_wire"))]
    assert len(rows) == len(predicted) + 1 and all(r["ok"] and abs(r["rel_diff"]) < 1e-9 for r in rows)
    del zero3["wire_packets_by_link_per_step"]
    report = plan_check.check_results(results)
    assert not any(r["ok"] for r in report["rows"] if r["arm"] == "zero3" and r["quantity"].startswith("link "))
    zero3["wire_packets_by_link_per_step"] = {name: f * 0.8 for name, f in frames.items()}   # 10 % of payload
    assert not plan_check.check_results(results)["ok"]


@pytest.mark.parametrize("topology", ["shared", "rails"])
def test_gloo_control_bytes_ride_on_the_links_their_messages_take(topology):
    """A message from rank 1 (node 0) to rank 2 (node 1, local index 0) leaves node 0 on rail 0 and its answers
    leave node 1 on rail 0; one from rank 0 to rank 3 (local index 1) uses rail 1 both ways (one link per node:
    eth0 for all)."""
    config = {"nproc": 4, "node_size": 2, "network": {"topology": topology}}
    out_ring, back_ring = plan_check.GLOO_CONTROL_BYTES["ring"]
    out_pair, back_pair = plan_check.GLOO_CONTROL_BYTES["pairwise"]
    loads = plan_check.control_link_loads(config, {"ring": {"1>2": 3}, "pairwise": {"0>3": 2}})
    rail = 1 if topology == "rails" else 0
    expected = {"node0/eth0": 3 * out_ring, "node1/eth0": 3 * back_ring}
    expected[f"node0/eth{rail}"] = expected.get(f"node0/eth{rail}", 0) + 2 * out_pair
    expected[f"node1/eth{rail}"] = expected.get(f"node1/eth{rail}", 0) + 2 * back_pair
    assert loads == pytest.approx(expected)
    assert plan_check.control_link_loads(config, None) == {}

def test_check_json_and_unreadable_files(tmp_path, capsys):
    results = _synthetic_results({"gathered": 10_000, "reduced": 8_000, "trainable": 8_000}, with_elements=True)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert plan_cli.main(["--check", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert plan_cli.main(["--check", str(tmp_path / "missing.json")]) == 2
    path.write_text(json.dumps({"arms": {}}))
    assert plan_cli.main(["--check", str(path)]) == 2
    assert "config" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ mixture of experts
MOE = dict(num_params=47 * 10**9, world=256, node_size=8, grad_accum=8, dtype="bf16", intra_bw=400e9,
           inter_bw=25e9, device_memory=80 * 2**30, param_shard_size=8, optimizer_shard_size=256)


def _moe_plan(ep=8, grad_accum=8, tokens=4096, **kw):
    from ds_asynchzp.planner.moe import MoeInputs
    args = dict(MOE, grad_accum=grad_accum, **kw)
    return cluster_plan.plan(**args, moe=MoeInputs(45 * 10**9, ep, tokens, 4096, 2))


def test_moe_plan_splits_dense_expert_and_token_bytes():
    plan = _moe_plan()
    assert plan["moe"]["expert_group"] == {"members": 32, "per_node": 1}
    for arm in ("zero3", "asynchzp", "asynchzp-q"):
        entry = plan["arms"][arm]
        families = entry["by_family"]
        for where in ("intra_node", "inter_node"):
            assert entry["bytes_per_step"][where] == pytest.approx(sum(f[where] for f in families.values()))
    # ep = node size: the token all-to-all stays inside the node, and is the same for every arm.
    tokens = plan["arms"]["zero3"]["by_family"]["tokens"]
    assert tokens["inter_node"] == 0 and tokens["intra_node"] == pytest.approx(8 * 4 * 4096 * 2 * 4096 * 2 * 7 / 8)
    assert plan["arms"]["asynchzp"]["by_family"]["tokens"] == tokens
    # DeepSpeed refuses hpZ with AutoEP: those arms are not planned.
    assert plan["arms"]["hpz"]["unavailable"] and plan["arms"]["zeropp"]["unavailable"]


def test_moe_expert_bytes_follow_the_expert_layout():
    from ds_asynchzp.layout import HierarchicalLayout, expert_layout
    one, eight = _moe_plan(grad_accum=1), _moe_plan(grad_accum=8)
    expert = lambda plan, arm: plan["arms"][arm]["by_family"]["expert"]["inter_node"]  # noqa: E731
    # Stock ZeRO-3 moves every expert over its (cross-node) group every micro-step; AsyncHZP once per step.
    assert expert(eight, "zero3") == pytest.approx(8 * expert(one, "zero3"))
    assert expert(eight, "asynchzp") == pytest.approx(expert(one, "asynchzp"))
    # The experts' layout is the engine's: with one member of the group per node, no sharding inside the node.
    layout = expert_layout(32, 1, HierarchicalLayout(256, 8, 8, 8, 256))
    assert (layout.param_shard_size, layout.grad_shard_size, layout.optimizer_shard_size) == (1, 1, 32)
    local = 45 * 10**9 // 8
    assert expert(one, "asynchzp") == pytest.approx((2 + 2) * local * 31 / 32, rel=1e-6)
    # ep spanning two nodes: the tokens cross them.
    wide = _moe_plan(ep=16)
    assert wide["arms"]["zero3"]["by_family"]["tokens"]["inter_node"] > 0


@pytest.mark.parametrize("ep, problem", [(3, "must divide the world"), (12, "must divide the world")])
def test_moe_plan_refuses_bad_ep(ep, problem):
    with pytest.raises(ValueError, match=problem):
        _moe_plan(ep=ep)


def test_plan_cli_prints_families(capsys):
    from ds_asynchzp.planner import cli
    assert cli.main(["--params", "47B", "--expert-params", "45B", "--ep-size", "8", "--tokens", "4096",
                     "--hidden", "4096", "--world", "256", "--node-size", "8", "--intra-bw", "400GB/s",
                     "--inter-bw", "200Gbit", "--grad-accum", "8", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "expert GB/NIC" in out and "hpz: not planned" in out and "32 ranks, 1 per node" in out


def test_check_refuses_moe_results_by_name():
    results = {"config": {"model": "moe", "ep_size": 2, "nproc": 4, "node_size": 2}, "arms": {}}
    with pytest.raises(ValueError, match="MoE model.*--check covers dense models only"):
        plan_check.check_results(results)


def test_volume_table_by_flow_passes_formula_flows_and_flags_a_planted_mismatch():
    """ZeRO++'s volume table: flows recorded at the formulas' figures pass; a flow 10 % off is flagged, in the
    check and in the report's table, while the arm's total stays unchanged (bytes moved between flows)."""
    from ds_asynchzp.bench.volume_table import format_volume_table
    from ds_asynchzp.planner import volume

    elements = {"gathered": 123_456, "reduced": 100_000, "trainable": 101_000, "qgz": 60_000}
    results = _synthetic_results(elements, with_elements=True)
    del results["arms"]["mystery"], results["arms"][O4_ARM]
    t = dataclasses.replace(_inputs(elements), qgz_elements=60_000)
    results["arms"]["zeropp"] = {"bytes_per_step": arm_formulas.zeropp_bytes(t)}
    for arm, entry in results["arms"].items():
        sizes = (4, 4, 8) if arm == "asynchzp" else (None, None, None)
        flows = volume.arm_flows(arm, t if arm == "zeropp" else _inputs(elements), *sizes,
                                 arm_formulas.arm_quantization(arm, 8, 4, 4, 4, 8) if arm == "asynchzp" else None)
        entry["bytes_per_step_by_flow"] = {f: {"inter_node": v, "intra_node": 0.0} for f, v in flows.items()}
    report = plan_check.check_results(results)
    flow_rows = [r for r in report["rows"] if r["quantity"].startswith("inter_node ")]
    assert {r["arm"] for r in flow_rows} == {"zero3", "hpz", "zeropp", "asynchzp"} and report["ok"], report["rows"]
    # Each arm's flows add up to its inter-node total.
    for arm, entry in results["arms"].items():
        assert sum(v["inter_node"] for v in entry["bytes_per_step_by_flow"].values()) == pytest.approx(
            entry["bytes_per_step"]["inter_node"])
    table = "\n".join(format_volume_table(results))
    assert "off by more than" not in table and "published accounting" in table
    planted = copy.deepcopy(results)
    flows = planted["arms"]["zero3"]["bytes_per_step_by_flow"]
    moved = 0.10 * flows["backward gather"]["inter_node"]
    flows["backward gather"]["inter_node"] -= moved
    flows["forward gather"]["inter_node"] += moved
    assert not plan_check.check_results(planted)["ok"]
    assert "| zero3 |" in (table := "\n".join(format_volume_table(planted))) and "off by more than 5 %" in table
    # Quantization scales recorded apart: the payload ratio leaves them out, the total ratio keeps them.
    assert "not recorded" in table
    scaled = copy.deepcopy(results)
    for entry in scaled["arms"].values():
        for part in entry["bytes_per_step_by_flow"].values():
            part["inter_node_scales"] = 0.0
    reduction = scaled["arms"]["zeropp"]["bytes_per_step_by_flow"]["gradient reduction"]
    reduction["inter_node_scales"] = reduction["inter_node"] / 2
    totals = {arm: sum(v["inter_node"] for v in scaled["arms"][arm]["bytes_per_step_by_flow"].values())
              for arm in ("zero3", "zeropp")}
    row = next(line for line in format_volume_table(scaled) if line.startswith("| zeropp |")).split(" | ")
    assert float(row[-3]) == pytest.approx(totals["zeropp"] / totals["zero3"], abs=1e-3)
    assert float(row[-2]) == pytest.approx((totals["zeropp"] - reduction["inter_node"] / 2) / totals["zero3"],
                                           abs=1e-3)


def test_sequence_parallel_all_to_alls_and_fp32_gradients_in_every_arm():
    """Ulysses SP: per layer and micro-step a rank sends (sp-1)/sp of its q, k, v and output slices, forward and
    backward; inside the node when sp divides it, else the share of peers on other nodes crosses. Gradient flows go
    fp32 (seq_parallel_communication_data_type's default) in every arm."""
    from ds_asynchzp.planner import sequence_parallel as sp_plan

    sp = sp_plan.SpInputs(sp=4, seq_len=1024, hidden=64, layers=3, kv_hidden=16)
    per_rank_tokens = 1024 // 4
    expected = 2 * 3 * 2 * per_rank_tokens * (2 * 64 + 2 * 16) * 2 * 3 / 4     # passes, layers, accum, bf16
    inside = sp_plan.all_to_all_bytes(sp, world=16, node_size=8, grad_accum=2, value_bytes=2)
    assert inside == {"intra_node": expected, "inter_node": 0.0}
    # sp 16 over nodes of 8: 8 of each rank's 15 peers are on the other node.
    assert sp_plan.inter_node_share(16, 16, 8) == pytest.approx(8 / 15)
    assert sp_plan.inter_node_share(4, 16, 8) == 0.0

    with_sp = cluster_plan.plan(10**9, 16, 8, grad_accum=2, param_shard_size=8, optimizer_shard_size=16, sp=sp)
    plain = cluster_plan.plan(10**9, 16, 8, grad_accum=2, param_shard_size=8, optimizer_shard_size=16)
    assert with_sp["inputs"]["grad_comm_bytes"] == 4 and plain["inputs"]["grad_comm_bytes"] == 2
    for arm in ("zero3", "asynchzp"):
        assert with_sp["arms"][arm]["sp_all_to_all"] == inside
    # zero3's bytes: its formula with fp32 gradients, plus the all-to-alls; more than without SP.
    t = arm_formulas.traffic_inputs(10**9, 16, 8, 2, "bf16", grad_comm_bytes=4)
    zero3 = traffic.zero3_bytes(t)
    for where in ("intra_node", "inter_node"):
        assert with_sp["arms"]["zero3"]["bytes_per_step"][where] == pytest.approx(zero3[where] + inside[where])
    assert with_sp["arms"]["zero3"]["bytes_per_step"]["inter_node"] > plain["arms"]["zero3"]["bytes_per_step"]["inter_node"]
    assert "every SP group inside a node" in with_sp["sequence_parallel"]["description"]
    with pytest.raises(ValueError, match="multiple of sp"):
        cluster_plan.plan(10**9, 16, 8, sp=sp_plan.SpInputs(sp=4, seq_len=1022, hidden=64, layers=3))


def test_plan_cli_sp_needs_the_sequence_and_model_shape(capsys):
    with pytest.raises(SystemExit):
        plan_cli.main(["--params", "1B", "--world", "16", "--node-size", "8", "--sp", "4"])
    assert "--sp needs --seq-len, --layers, --hidden" in capsys.readouterr().err
    assert plan_cli.main(["--params", "1B", "--world", "16", "--node-size", "8", "--sp", "4", "--seq-len", "4096",
                     "--layers", "8", "--hidden", "1024"]) == 0
    assert "Ulysses sequence parallelism sp=4" in capsys.readouterr().out
