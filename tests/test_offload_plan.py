"""Optimizer offload in the arithmetic: device and host bytes per rank (formulas.sizing), the host<->device flow
(formulas.traffic), "auto" with offload (sizing.choose_layout, config.resolve_layout) and
``asynchzp-plan --offload-optimizer``. By hand for small cases, then the 70B example. No ranks."""

from __future__ import annotations

import json

import pytest

from ds_asynchzp.formulas import sizing, step_collectives, traffic
from ds_asynchzp.config import resolve_layout
from ds_asynchzp.errors import AsyncHZPConfigError
from ds_asynchzp.planner import arm_formulas, cluster_plan
from ds_asynchzp.planner import cli as plan_cli
from ds_asynchzp.planner import offload as offload_plan
from ds_asynchzp.planner.moe import MoeInputs

GIB = 2**30
# The worked example: 70B bf16 parameters, 2 nodes of 8 ranks, 80 GB devices, 8 micro-steps per step.
PSI, WORLD, NODE = 70 * 10**9, 16, 8
# NVLink at 400 GB/s per rank (A100/H100 class), one 25 GB/s NIC per rank: a gradient ring over the world is then
# bound by the NICs, and node-local gradient shards are worth keeping where they fit.
ARGV_70B = ["--params", "70B", "--world", "16", "--node-size", "8", "--device-memory", "80GB", "--grad-accum", "8",
            "--intra-bw", "400GB/s"]


# ------------------------------------------------------------------------------------ memory by hand
def test_asynchzp_placement_by_hand():
    """Ψ = 1200, Ψ_t = 1000, N = 8, d_p = 2, d_g = 4, d_o = 4, b = 2, a = 4 (so a swapped dtype shows)."""
    kw = dict(param_bytes=2, grad_accum_bytes=4, num_trainable=1000)
    off = sizing.placement_bytes_per_rank(1200, 8, 2, 4, 4, offload_optimizer=True, **kw)
    assert off["device"] == {"param_shard": 2 * 1200 // 2, "grad_shard": 4 * 1000 // 4, "total": 1200 + 1000}
    assert off["host"] == {"master": 4 * 1000 // 4, "optimizer_state": 8 * 1000 // 4, "fp32_grad": 4 * 1000 // 4,
                           "total": 1000 + 2000 + 1000}
    # Without offload everything stays on the device: exactly the model-state model.
    on_device = sizing.placement_bytes_per_rank(1200, 8, 2, 4, 4, offload_optimizer=False, **kw)
    assert on_device["device"] == sizing.model_state_bytes_per_rank(1200, 8, 2, 4, 4, **kw)
    assert on_device["host"] == {"total": 0}


def test_stock_placement_by_hand():
    """Stock ZeRO-3 at N = 8 keeps only its parameter partition on the device under offload; its gradient
    partition (a·Ψ_t/N) joins master, moments and fp32 gradients on the host. hpZ adds b·Ψ/G on the device."""
    kw = dict(param_bytes=2, grad_accum_bytes=4, num_trainable=1000)
    zero3 = sizing.stock_placement_bytes_per_rank(1200, 8, offload_optimizer=True, **kw)
    assert zero3["device"] == {"param_shard": 300, "total": 300}
    assert zero3["host"] == {"grad_shard": 500, "master": 500, "optimizer_state": 1000, "fp32_grad": 500,
                             "total": 2500}
    hpz = sizing.stock_placement_bytes_per_rank(1200, 8, offload_optimizer=True, secondary_size=4, **kw)
    assert hpz["device"] == {"param_shard": 300, "param_secondary": 600, "total": 900}
    assert hpz["host"] == zero3["host"]
    plain = sizing.stock_placement_bytes_per_rank(1200, 8, offload_optimizer=False, **kw)
    assert plain["device"] == sizing.model_state_bytes_per_rank(1200, 8, 8, 8, 8, **kw) and plain["host"]["total"] == 0


# ------------------------------------------------------------------------------- host<->device by hand
# N = 8 in nodes of 4, A = 2, P_r = 1000, P_t = 1120 (P_t/N = 140), b = 2.
T = traffic.TrafficInputs(world=8, node_size=4, grad_accum=2, gathered_elements=1200, reduced_elements=1000,
                          trainable_elements=1120, param_bytes=2, grad_comm_bytes=2)


def test_host_device_bytes_by_hand():
    # Stock, a = 4: every micro-step a·P_r/N out and back; at the boundary 4·P_r/N out; after the step b·P_t/N in.
    stock = traffic.stock_offload_host_device_bytes(T, grad_accum_bytes=4)
    assert stock == {"to_host": pytest.approx(2 * 4 * 125 + 4 * 125), "to_device": pytest.approx(2 * 4 * 125 + 2 * 140),
                     "total": pytest.approx(1500 + 1280)}
    # AsyncHZP, d_o = 4: its own atoms' fp32 gradients of the reduced parameters out (4·P_r/d_o = 4·250), the
    # parameters of all its trainable atoms back (b·P_t/d_o = 2·280).
    ours = traffic.asynchzp_host_device_bytes(T, 4)
    assert ours == {"to_host": pytest.approx(4 * 250), "to_device": pytest.approx(2 * 280),
                    "total": pytest.approx(1560)}
    assert traffic.asynchzp_host_device_bytes(T) == traffic.asynchzp_host_device_bytes(T, 8)  # d_o defaults to N
    # The closed form with P_r = P_t = P: (2·a·A + 4 + b)·P/N.
    even = traffic.TrafficInputs(world=8, node_size=4, grad_accum=3, gathered_elements=800, reduced_elements=800,
                                 trainable_elements=800, param_bytes=2, grad_comm_bytes=2)
    assert traffic.stock_offload_host_device_bytes(even)["total"] == pytest.approx((2 * 2 * 3 + 4 + 2) * 800 / 8)
    # Dispatch by arm: hpZ and ZeRO++ share stock's gradient path, quantized AsyncHZP arms copy what asynchzp does.
    for arm in ("zero3", "hpz", "zeropp"):
        assert traffic.host_device_bytes(arm, T, grad_accum_bytes=4) == stock
    for arm in ("asynchzp", "asynchzp-q", "asynchzp:optimizer_shard_size=4"):
        assert traffic.host_device_bytes(arm, T, 4) == ours
    # The benchmark's offload arms copy what their twins copy under offload.
    assert traffic.host_device_bytes("zero3-offload", T, grad_accum_bytes=4) == stock
    for arm in ("asynchzp-offload", "asynchzp-offload:optimizer_shard_size=4"):
        assert traffic.host_device_bytes(arm, T, 4) == ours
    with pytest.raises(ValueError, match="host<->device"):
        traffic.host_device_bytes("mystery", T)
    with pytest.raises(ValueError, match="divide"):
        traffic.asynchzp_host_device_bytes(T, 3)
    assert traffic.HOST_DEVICE not in traffic.FLOWS  # a copy over PCIe, not a network flow


@pytest.mark.parametrize("world, node", [(16, 8), (1024, 16)])
def test_asynchzp_copies_do_not_grow_with_accumulation_and_stay_below_stock(world, node):
    """bf16, d_o = N: AsyncHZP copies (4 + 2)·Ψ/N whatever A; stock (2·2·A + 6)·Ψ/N, 22·Ψ/N at A = 4."""
    def inputs(grad_accum):
        return arm_formulas.traffic_inputs(PSI, world, node, grad_accum, "bf16")

    ours = {a: traffic.asynchzp_host_device_bytes(inputs(a))["total"] for a in (1, 4, 8, 32)}
    assert len(set(ours.values())) == 1
    stock = {a: traffic.stock_offload_host_device_bytes(inputs(a))["total"] for a in (1, 4, 8, 32)}
    assert stock[1] < stock[4] < stock[8] < stock[32]
    assert ours[4] <= 0.4 * stock[4]
    assert ours[4] / stock[4] == pytest.approx(6 / 22)


def test_a_parameter_without_gradient_is_copied_back_but_not_out():
    """120 of T's trainable elements receive no gradient (P_r = 1000, P_t = 1120): their gradients cross in
    neither direction, their updated parameters still come back (b·P_t/..)."""
    everything = traffic.TrafficInputs(world=8, node_size=4, grad_accum=2, gathered_elements=1200,
                                       reduced_elements=1120, trainable_elements=1120, param_bytes=2,
                                       grad_comm_bytes=2)

    def less(formula) -> dict:
        full, partial = formula(everything), formula(T)
        return {k: full[k] - partial[k] for k in ("to_host", "to_device")}

    # AsyncHZP, d_o = 4: only the boundary's fp32 gradients shrink, 4·120/4.
    assert less(lambda t: traffic.asynchzp_host_device_bytes(t, 4)) == {"to_host": pytest.approx(4 * 30),
                                                                      "to_device": 0}
    # Stock, a = 4, N = 8: the micro-step round trips (A·a·120/8 each way) and the boundary copy (4·120/8).
    assert less(lambda t: traffic.stock_offload_host_device_bytes(t, 4)) == {
        "to_host": pytest.approx(2 * 4 * 15 + 4 * 15), "to_device": pytest.approx(2 * 4 * 15)}


def test_offload_arms_have_their_twins_formulas():
    """zero3-offload and asynchzp-offload are zero3 and asynchzp with the optimizer on the host: one name rule
    (traffic.offload_twin) gives their network bytes, placement and copies."""
    assert traffic.offload_twin("zero3-offload") == "zero3"
    assert traffic.offload_twin("asynchzp-offload:param_shard_size=2") == "asynchzp:param_shard_size=2"
    assert traffic.offload_twin("asynchzp-q") == "asynchzp-q" and traffic.offload_twin("zero3") == "zero3"
    for arm, twin in (("zero3-offload", "zero3"), ("asynchzp-offload", "asynchzp")):
        assert arm_formulas.arm_bytes(arm, T, 2, 4, 4) == arm_formulas.arm_bytes(twin, T, 2, 4, 4)
        assert step_collectives.link_bytes(arm, T, 2, 4, 4) == step_collectives.link_bytes(twin, T, 2, 4, 4)
        for offload in (True, False):
            args = (1120, 8, 4, 2, 4, 4, 2, 4, offload)
            assert offload_plan.arm_placement(arm, *args) == offload_plan.arm_placement(twin, *args)
    with pytest.raises(ValueError, match="mystery-offload"):
        offload_plan.arm_placement("mystery-offload", 1120, 8, 4, 2, 4, 4, 2, 4, True)


# -------------------------------------------------------------------------------------------- "auto"
def test_choose_layout_with_offload_budgets_device_bytes_only():
    budget = 40 * GIB  # half of an 80 GB device
    kw = dict(grad_accum_steps=8, intra_bw_bytes_s=400e9, inter_bw_bytes_s=25e9)
    with pytest.raises(AsyncHZPConfigError, match="memory_budget_gb"):
        sizing.choose_layout(PSI, WORLD, NODE, budget, **kw)
    d_p, d_g, d_o, reason = sizing.choose_layout(PSI, WORLD, NODE, budget, offload_optimizer=True, **kw)
    assert NODE % d_g == 0
    assert "offload taken into account" in reason and "host<->device" in reason and "runner-up" in reason
    placed = sizing.placement_bytes_per_rank(PSI, WORLD, d_p, d_g, d_o, offload_optimizer=True)
    assert placed["device"]["total"] <= budget
    assert f"host {placed['host']['total'] / GIB:.2f} GiB per rank" in reason
    # The copies count: of two layouts with the same network bytes, the one copying less (larger d_o) wins.
    assert (d_p, d_g, d_o) == (8, 8, 16)
    assert "runner-up d_p=8, d_g=8, d_o=8 (host<->device 52.5 GB)" in reason
    # Brute force: least time (network plus copies at the assumed rate), then less device, then less host memory.
    fits = [lay for lay in sizing.valid_layouts(WORLD, NODE)
            if sizing.placement_bytes_per_rank(PSI, WORLD, *lay, offload_optimizer=True)["device"]["total"] <= budget]
    best = min(fits, key=lambda lay: (round(sizing.comm_seconds_per_step(
        PSI, WORLD, NODE, *lay, param_bytes=2, grad_comm_bytes=2, offload_optimizer=True, **kw)[0], 9), lay))
    assert best == (d_p, d_g, d_o)


def test_offload_no_fit_and_smallest_device_layout():
    with pytest.raises(AsyncHZPConfigError, match="device bytes") as info:
        sizing.choose_layout(PSI, WORLD, NODE, 20 * GIB, offload_optimizer=True)
    # Least device bytes: d_p = 8, d_g = 16 (2·Ψ/8 + 2·Ψ/16 = 26.25e9); the host tie-break then takes d_o = N.
    assert sizing.smallest_memory_layout(PSI, WORLD, NODE, offload_optimizer=True) == (8, 16, 16, 26_250_000_000)
    assert "26250000000 bytes" in str(info.value)


def _ds_config(offload: bool, budget_gb: float) -> dict:
    zero = {"stage": 3, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero,
            "async_hzp": {"node_size": NODE, "param_shard_size": "auto", "grad_shard_size": "auto",
                          "optimizer_shard_size": "auto", "memory_budget_gb": budget_gb,
                          "intra_node_bandwidth_gbps": 3200}}


def test_resolve_layout_with_offload_keeps_gradients_in_the_node():
    """A 76 GiB budget: without offload only d_g = 16 fits (8, 16, 16: 73.3 GiB; any d_g <= 8 needs >= 81.5
    GiB); with the optimizer on the host the device keeps b·Ψ/d_p + a·Ψ/d_g (8, 8: 32.6 GiB; 4, 4: 65.2 GiB), so
    node-local gradient shards fit and win."""
    plain = resolve_layout(_ds_config(False, 76), WORLD, NODE, num_parameters=PSI)
    assert plain.sizes.grad_shard_size == 16 and "offload" not in plain.auto_reason
    offloaded = resolve_layout(_ds_config(True, 76), WORLD, NODE, num_parameters=PSI)
    sizes = offloaded.sizes
    chosen = (sizes.param_shard_size, sizes.grad_shard_size, sizes.optimizer_shard_size)
    assert chosen[1] <= NODE and NODE % chosen[1] == 0
    assert sizing.placement_bytes_per_rank(PSI, WORLD, *chosen, offload_optimizer=True)["device"]["total"] <= 76 * GIB
    # resolve_layout hands choose_layout the ds_config's offload, and nothing else changes.
    assert sizing.choose_layout(PSI, WORLD, NODE, 76 * GIB, grad_accum_steps=8, offload_optimizer=True,
                                intra_bw_bytes_s=400e9) == \
        (*chosen, offloaded.auto_reason)
    assert "optimizer offload taken into account" in offloaded.auto_reason
    assert offloaded.auto_reason in offloaded.describe()


# ---------------------------------------------------------------------------------------- the planner
def test_plan_70b_with_offload_keeps_gradients_in_the_node(capsys):
    assert plan_cli.main([*ARGV_70B, "--offload-optimizer", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    layout = data["layout"]
    assert layout["source"] == "auto" and layout["d_g"] <= NODE and NODE % layout["d_g"] == 0
    assert data["auto"]["error"] is None and "offload" in data["auto"]["reason"]
    assert data["inputs"]["offload_optimizer"] is True
    # Without offload "auto" cannot keep d_g inside the node: nothing fits the 40 GiB budget, and no layout with
    # d_g <= 8 fits even the whole 80 GiB device.
    assert data["auto_without_offload"]["error"] is not None
    node_local = [lay for lay in sizing.valid_layouts(WORLD, NODE) if NODE % lay[1] == 0]
    assert min(sizing.model_state_bytes_per_rank(PSI, WORLD, *lay)["total"] for lay in node_local) > 80 * GIB
    plain = cluster_plan.plan(PSI, WORLD, NODE, 8, device_memory=80 * GIB)
    assert plain["auto"]["error"] is not None and plain["layout"]["d_g"] > NODE
    # Every arm: device and host with and without offload, and the host<->device bytes.
    for arm, entry in data["arms"].items():
        off = entry["offload_optimizer"]
        assert off["without_offload"]["device_bytes"]["total"] == entry["model_state_bytes"]["total"]
        assert off["without_offload"]["host_bytes"]["total"] == 0
        assert off["host_bytes"]["total"] > 0 and off["device_bytes"]["total"] < entry["model_state_bytes"]["total"]
        assert off["fits_device_memory"] is True
        assert off["comm_time_s"] == pytest.approx(entry["comm_time_s"]["total"] + off["host_device_s"])
    ours, zero3 = (data["arms"][a]["offload_optimizer"]["host_device_bytes_per_step"]["total"]
                   for a in ("asynchzp", "zero3"))
    assert ours == pytest.approx((4 + 2) * PSI / 16) and zero3 == pytest.approx((2 * 2 * 8 + 4 + 2) * PSI / 16)
    # Offload leaves the network flows alone: the same layout planned without it moves the same bytes.
    same = cluster_plan.plan(PSI, WORLD, NODE, 8, intra_bw=cluster_plan.DEFAULT_INTRA_BW,
                             inter_bw=cluster_plan.DEFAULT_INTER_BW,
                             device_memory=80 * GIB, param_shard_size=layout["d_p"], grad_shard_size=layout["d_g"],
                             optimizer_shard_size=layout["d_o"])
    assert same["arms"]["asynchzp"]["bytes_per_step"]["inter_node"] == \
        data["arms"]["asynchzp"]["bytes_per_step"]["inter_node"]

    assert plan_cli.main([*ARGV_70B, "--offload-optimizer"]) == 0
    table = capsys.readouterr().out
    assert "device w/o offload" in table and "h<->d GB/step" in table
    assert f"asynchzp (d_p={layout['d_p']} d_g={layout['d_g']} d_o={layout['d_o']}) keeps its gradient shards " \
           "inside the node" in table
    inter = {arm: data["arms"][arm]["bytes_per_step"]["inter_node"] / 1e9 for arm in ("asynchzp", "zero3", "hpz")}
    assert f": {inter['asynchzp']:,.1f} GB across nodes" in table
    assert f"stock ZeRO-3 offload: {inter['zero3']:,.1f} GB across nodes" in table
    assert f"ZeRO++ hpZ offload: {inter['hpz']:,.1f} GB across nodes" in table
    assert '"auto" without offload finds no layout' in table and "(async_hzp's defaults where not given)" in table


def test_plan_auto_with_offload_is_choose_layout():
    result = cluster_plan.plan(PSI, WORLD, NODE, 8, intra_bw=200e9, inter_bw=50e9, device_memory=80 * GIB,
                               offload_optimizer=True)
    *expected, reason = sizing.choose_layout(PSI, WORLD, NODE, 40 * GIB, grad_accum_steps=8, intra_bw_bytes_s=200e9,
                                             inter_bw_bytes_s=50e9, offload_optimizer=True)
    assert [result["auto"][k] for k in ("d_p", "d_g", "d_o")] == expected and result["auto"]["reason"] == reason
    # Nothing fits: the arms use the smallest-device layout, flagged in the offload columns.
    tight = cluster_plan.plan(PSI, WORLD, NODE, 8, intra_bw=200e9, inter_bw=50e9, device_memory=20 * GIB,
                              offload_optimizer=True)
    assert tight["auto"]["error"] is not None
    assert (tight["layout"]["d_p"], tight["layout"]["d_g"], tight["layout"]["d_o"]) == (8, 16, 16)
    assert tight["arms"]["asynchzp"]["offload_optimizer"]["fits_device_memory"] is False
    assert tight["arms"]["zero3"]["offload_optimizer"]["fits_device_memory"] is True


def test_plan_without_the_flag_carries_no_offload(capsys):
    result = cluster_plan.plan(PSI, WORLD, NODE, 8, intra_bw=100e9, inter_bw=25e9, device_memory=80 * GIB)
    assert "auto_without_offload" not in result and "offload_optimizer" not in result["inputs"]
    assert all("offload_optimizer" not in entry for entry in result["arms"].values())
    assert plan_cli.main([*ARGV_70B, "--intra-bw", "100GB/s", "--inter-bw", "200Gbit"]) == 0
    table = capsys.readouterr().out
    assert "model states/rank" in table and "h<->d" not in table and "defaults where not given" not in table


def test_offload_with_experts_is_refused(capsys):
    assert pytest.raises(SystemExit, plan_cli.main, [*ARGV_70B, "--offload-optimizer", "--expert-params", "30B",
                                                     "--ep-size", "8"]).value.code == 2
    assert "--offload-optimizer" in capsys.readouterr().err
    with pytest.raises(ValueError, match="offload"):
        cluster_plan.plan(PSI, WORLD, NODE, moe=MoeInputs(30 * 10**9, 8, 0, 0, 2), offload_optimizer=True)


@pytest.mark.parametrize("d_o, expected", [(16, 6 / 22), (8, 2 * 6 / 22)])
def test_the_plan_states_the_host_device_ratio_and_its_dependence_on_d_o(d_o, expected):
    """bf16 (a = b = 2), GA 4: (N/d_o)*(4 + b)/(2*a*A + 4 + b) = 0.27 with d_o = N, 0.55 with d_o = N/2."""
    result = cluster_plan.plan(8 * 10**9, 16, 8, 4, "bf16", optimizer_shard_size=d_o, offload_optimizer=True)
    text = offload_plan.summary(result)
    assert f"Host<->device bytes {expected:.2f}x stock's" in text, text
    assert f"optimizer replicas N/d_o ({16 // d_o} here)" in text
    assert ("d_o = N would divide them by 2" in text) == (d_o == 8)
