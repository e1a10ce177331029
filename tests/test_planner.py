"""``asynchzp-plan`` (ds_asynchzp.planner, ds_asynchzp.plan_cli): unit parsing, the planned numbers against the
traffic formulas and the memory model, the "auto" pick, and ``--check`` against a results.json. No ranks."""

from __future__ import annotations

import copy
import json

import pytest

from ds_asynchzp import plan_cli, planner, sizing, traffic

GIB = 2**30
# The reference example: 70B params, 1024 ranks in nodes of 16, 400 GB/s intra, 200 Gbit/s inter, 64 GB devices.
EXAMPLE = dict(num_params=70 * 10**9, world=1024, node_size=16, dtype="bf16", intra_bw=400e9, inter_bw=25e9,
               device_memory=64 * GIB)


def _plan(grad_accum=8, **changes):
    return planner.plan(grad_accum=grad_accum, **dict(EXAMPLE, **changes))


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
    assert planner.parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["400", "fast", "400GB/h", "GB/s", "-5GB/s", "0GB/s"])
def test_bad_bandwidths_are_rejected(text):
    with pytest.raises(ValueError):
        planner.parse_bandwidth(text)


@pytest.mark.parametrize("text, expected", [
    ("80GB", 80 * GIB), ("64GiB", 64 * GIB), ("40000MB", 40000 * 2**20), ("1.5TB", int(1.5 * 2**40)), ("96 G B", None),
])
def test_memory_sizes_are_binary(text, expected):
    if expected is None:
        with pytest.raises(ValueError):
            planner.parse_memory(text)
    else:
        assert planner.parse_memory(text) == expected


@pytest.mark.parametrize("text", ["80", "80Gbit", "80GB/s", "eighty GB"])
def test_bad_memory_sizes_are_rejected(text):
    with pytest.raises(ValueError):
        planner.parse_memory(text)


@pytest.mark.parametrize("text, expected", [
    ("7e9", 7 * 10**9), ("70B", 70 * 10**9), ("70b", 70 * 10**9), ("1.3M", 1_300_000), ("350k", 350_000),
    ("1_000_000", 10**6), ("1T", 10**12), ("123", 123),
])
def test_parameter_counts(text, expected):
    assert planner.parse_count(text) == expected


@pytest.mark.parametrize("text", ["abc", "0", "70X", "7e9 params", ""])
def test_bad_parameter_counts_are_rejected(text):
    with pytest.raises(ValueError):
        planner.parse_count(text)


def test_cli_reports_a_bad_unit_as_a_usage_error(capsys):
    assert _exit_code(["--params", "7B", "--world", "8", "--node-size", "4", "--intra-bw", "400",
                       "--inter-bw", "25GB/s"]) == 2
    assert "--intra-bw" in capsys.readouterr().err


def test_model_spec_parameter_count():
    dense = {"layers": 80, "hidden": 8192, "vocab": 32000}
    assert planner.params_from_model_spec(dense) == 12 * 80 * 8192**2 + 2 * 32000 * 8192
    assert planner.params_from_model_spec(dict(dense, tied=True)) == 12 * 80 * 8192**2 + 32000 * 8192
    swiglu = dict(dense, ffn_hidden=int(1.5 * 28672))
    assert planner.params_from_model_spec(swiglu) == 80 * (4 * 8192**2 + 3 * 8192 * 28672) + 2 * 32000 * 8192
    with pytest.raises(ValueError, match="vocab"):
        planner.params_from_model_spec({"layers": 2, "hidden": 64})
    with pytest.raises(ValueError, match="tied"):
        planner.params_from_model_spec(dict(dense, tied="false"))


def test_cli_reads_a_model_json(tmp_path, capsys):
    spec = tmp_path / "model.json"
    spec.write_text(json.dumps({"layers": 2, "hidden": 64, "vocab": 256, "tied": True}))
    plan_cli.main(["--model-json", str(spec), "--world", "8", "--node-size", "4", "--intra-bw", "100GB/s",
                   "--inter-bw", "10Gbit", "--device-memory", "16GB", "--json"])
    assert json.loads(capsys.readouterr().out)["inputs"]["params"] == 2 * 12 * 64**2 + 256 * 64


# ------------------------------------------------------------------------------------ planned traffic
def test_asynchzp_crosses_nodes_far_less_than_zero3_whatever_the_accumulation():
    plans = {gas: _plan(grad_accum=gas) for gas in (1, 8, 32)}
    inter = {gas: {arm: p["arms"][arm]["bytes_per_step"]["inter_node"] for arm in planner.ARMS}
             for gas, p in plans.items()}
    assert inter[1]["asynchzp"] == inter[8]["asynchzp"] == inter[32]["asynchzp"]
    assert inter[32]["zero3"] == pytest.approx(32 * inter[1]["zero3"])
    assert inter[8]["asynchzp"] < 0.01 * inter[8]["zero3"]
    # About (4 + b)·Ψ/G (docs/ARCHITECTURE.md), against ZeRO-3's A·(2b + b_c)·Ψ.
    assert inter[8]["asynchzp"] == pytest.approx(6 * 70e9 / 16, rel=0.02)
    assert plans[8]["layout"] == {"d_p": 16, "d_g": 16, "d_o": 1024, "source": "auto"}
    times = plans[8]["arms"]["asynchzp"]["comm_time_s"]
    moved = plans[8]["arms"]["asynchzp"]["bytes_per_step"]
    assert times["total"] == pytest.approx(moved["intra_node"] / 400e9 + moved["inter_node"] / 25e9)


def test_zeropp_crosses_nodes_a_quarter_of_zero3_per_micro_step():
    one = _plan(grad_accum=1)["arms"]
    ratio = one["zeropp"]["bytes_per_step"]["inter_node"] / one["zero3"]["bytes_per_step"]["inter_node"]
    assert 0.25 - 1e-9 <= ratio <= 0.5 and ratio == pytest.approx(0.25)  # (0.5 + 0 + 0.25) M / 3 M
    # hpZ's world gather happens once per step, so with accumulation the share falls towards 0.25 M / 3 M.
    eight = _plan(grad_accum=8)["arms"]
    ratio8 = eight["zeropp"]["bytes_per_step"]["inter_node"] / eight["zero3"]["bytes_per_step"]["inter_node"]
    assert 1 / 12 < ratio8 < ratio


def test_quantized_asynchzp_shrinks_only_the_micro_step_traffic():
    arms, padded, gas, g = _plan()["arms"], 70 * 10**9, 8, 16
    plain, quantized = arms["asynchzp"]["bytes_per_step"], arms["asynchzp-q"]["bytes_per_step"]
    assert quantized["inter_node"] == pytest.approx(plain["inter_node"])
    saved = gas * ((2 * 2 + 2) - (2 * planner.INT8_BYTES + planner.INT4_BYTES)) * padded * (g - 1) / g
    assert plain["intra_node"] - quantized["intra_node"] == pytest.approx(saved)


def test_arms_reuse_the_traffic_module():
    t = planner.traffic_inputs(70 * 10**9, 1024, 16, 8, "bf16")
    arms = _plan()["arms"]
    assert arms["zero3"]["bytes_per_step"] == traffic.zero3_bytes(t)
    assert arms["hpz"]["bytes_per_step"] == traffic.hpz_bytes(t)
    assert arms["asynchzp"]["bytes_per_step"] == traffic.asynchzp_bytes(t, 16, 16)


# ----------------------------------------------------------------------------------- memory and auto
@pytest.mark.parametrize("case", [
    dict(), dict(device_memory=120 * GIB), dict(num_params=7 * 10**9, world=64, node_size=8, device_memory=80 * GIB),
    dict(num_params=13 * 10**9 + 7, world=48, node_size=8, dtype="fp32", device_memory=80 * GIB),
])
def test_auto_is_what_choose_shard_sizes_picks(case):
    result = _plan(**case)
    inp = result["inputs"]
    budget = inp["device_memory_bytes"] * sizing.DEFAULT_BUDGET_FRACTION
    expected = sizing.choose_shard_sizes(inp["padded_params"], inp["world"], inp["node_size"], budget,
                                         param_bytes=inp["param_bytes"])
    assert (result["auto"]["d_p"], result["auto"]["d_g"], result["auto"]["d_o"]) == expected
    assert (result["layout"]["d_p"], result["layout"]["d_g"]) == expected[:2]


def test_explicit_budget_and_no_fit():
    assert _plan(memory_budget=60 * GIB)["auto"]["d_p"] == 8
    tight = _plan(device_memory=8 * GIB)
    assert tight["auto"]["d_p"] is None and "memory_budget_gb" in tight["auto"]["error"]
    assert tight["layout"]["d_p"] == 16 and tight["arms"]["asynchzp"]["fits_device_memory"] is False
    assert tight["arms"]["zero3"]["fits_device_memory"] is True


def test_memory_is_the_sizing_model():
    psi, world, node, b = 70 * 10**9, 1024, 16, 2
    arms = _plan()["arms"]
    assert arms["asynchzp"]["model_state_bytes"] == sizing.model_state_bytes_per_rank(psi, world, 16, 16, world, b)
    assert arms["asynchzp-q"]["model_state_bytes"] == arms["asynchzp"]["model_state_bytes"]
    full = sizing.model_state_bytes_per_rank(psi, world, world, world, world, b)
    zero3 = sum(full[r] for r in ("param_primary", "grad_primary", "master", "optimizer_state"))
    assert arms["zero3"]["model_state_bytes"]["total"] == zero3
    assert arms["hpz"]["model_state_bytes"]["total"] == zero3 + b * psi // node
    assert arms["zeropp"]["model_state_bytes"] == arms["hpz"]["model_state_bytes"]


def test_explicit_sizes_go_through_the_engine_layout_check(capsys):
    assert _plan(param_shard_size=8, grad_shard_size=16)["layout"]["source"] == "given"
    base = ["--params", "70B", "--world", "1024", "--node-size", "16", "--intra-bw", "400GB/s",
            "--inter-bw", "200Gbit"]
    assert _exit_code([*base, "--param-shard-size", "3"]) == 2
    assert "param_shard_size" in capsys.readouterr().err
    assert _exit_code([*base, "--param-shard-size", "8", "--grad-shard-size", "auto"]) == 2
    assert _exit_code(["--params", "70B"]) == 2
    assert "--world" in capsys.readouterr().err


def test_json_output_parses_and_the_table_lists_every_arm(capsys):
    argv = ["--params", "70B", "--world", "1024", "--node-size", "16", "--intra-bw", "400GB/s", "--inter-bw",
            "200Gbit", "--grad-accum", "8", "--device-memory", "64GB"]
    assert plan_cli.main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["arms"]) == set(planner.ARMS) and data["auto"]["d_p"] == 16
    assert data["inputs"]["inter_bw_bytes_per_s"] == 25e9 and data["inputs"]["device_memory_bytes"] == 64 * GIB
    assert plan_cli.main(argv) == 0
    table = capsys.readouterr().out
    assert '"auto" picks' in table and "d_p=16 d_g=16 d_o=1024" in table
    assert all(f"\n{arm} " in table for arm in planner.ARMS)


# ------------------------------------------------------------------------------------------ --check
BENCH_CONFIG = {"nproc": 8, "world_size": 8, "node_size": 4, "grad_accum": 4, "dtype": "fp32", "model": "tiny",
                "moe_experts": 0, "seq_len": 64, "arm_overrides": {"asynchzp": {"async_hzp": {"node_size": 4}}}}


def _synthetic_results(elements: dict, with_elements: bool) -> dict:
    t = traffic.TrafficInputs(world=8, node_size=4, grad_accum=4, gathered_elements=elements["gathered"],
                              reduced_elements=elements["reduced"], trainable_elements=elements["trainable"])
    arms = {"zero3": traffic.zero3_bytes(t), "hpz": traffic.hpz_bytes(t), "asynchzp": traffic.asynchzp_bytes(t, 4, 4)}
    results = {"config": copy.deepcopy(BENCH_CONFIG),
               "arms": {arm: {"bytes_per_step": dict(b)} for arm, b in arms.items()}}
    results["arms"]["mystery"] = {"bytes_per_step": {"intra_node": 1.0, "inter_node": 1.0}}
    if with_elements:
        results["config"]["elements"] = dict(elements)
    return results


def _check(tmp_path, results, capsys) -> tuple[int, str]:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    code = plan_cli.main(["--check", str(path)])
    return code, capsys.readouterr().out


def test_bench_element_counts_match_the_ledger_tests():
    from ds_asynchzp.bench.model import build_model
    from tests._dist_workers import _element_counts

    counts = planner.bench_element_counts(BENCH_CONFIG)
    expected = _element_counts(build_model("tiny"), 8)
    assert counts == {k: expected[k] for k in ("gathered", "reduced", "trainable")}
    assert counts["gathered"] > counts["trainable"] > counts["reduced"]  # tied weight twice; unused param


@pytest.mark.parametrize("with_elements", [True, False])
def test_check_passes_on_formula_bytes_and_fails_ten_percent_off(tmp_path, capsys, with_elements):
    elements = {"gathered": 123_456, "reduced": 100_000, "trainable": 101_000} if with_elements else \
        planner.bench_element_counts(BENCH_CONFIG)
    results = _synthetic_results(elements, with_elements)
    code, out = _check(tmp_path, results, capsys)
    assert code == 0, out
    assert "PASS" in out and "'mystery'" in out
    results["arms"]["asynchzp"]["bytes_per_step"]["inter_node"] *= 1.10
    code, out = _check(tmp_path, results, capsys)
    assert code == 1 and "MISMATCH" in out and "FAIL" in out


def test_check_zero_prediction_and_wire_bytes(tmp_path, capsys):
    elements = {"gathered": 123_456, "reduced": 100_000, "trainable": 101_000}
    results = _synthetic_results(elements, with_elements=True)
    zero3 = results["arms"]["zero3"]
    zero3["bytes_per_step"]["intra_node"] = 512  # a few scalars on a figure predicted to be 0
    # Node links carry only the ring edges between nodes: traffic.link_bytes, plus frame and ACK overhead
    # (no network section in the config: MTU 1500 on veth).
    t = planner.traffic.TrafficInputs(world=results["config"]["nproc"], node_size=results["config"]["node_size"],
                                      grad_accum=results["config"]["grad_accum"], gathered_elements=123_456,
                                      reduced_elements=100_000, trainable_elements=101_000, param_bytes=4,
                                      grad_comm_bytes=4)
    link = planner.traffic.link_bytes("zero3", t)
    assert link < zero3["bytes_per_step"]["inter_node"]
    zero3["wire_bytes_inter_node_per_step"] = link * planner.WIRE_OVERHEAD_FACTOR
    zero3["link_bytes_inter_node_per_step"] = link
    assert _check(tmp_path, results, capsys)[0] == 0
    report = planner.check_results(results)
    assert any(r["quantity"] == "inter_node_wire" and r["ok"] for r in report["rows"])
    zero3["wire_bytes_inter_node_per_step"] *= 1.10
    assert _check(tmp_path, results, capsys)[0] == 1
    zero3["wire_bytes_inter_node_per_step"] /= 1.10
    zero3["bytes_per_step"]["intra_node"] = 4096
    assert _check(tmp_path, results, capsys)[0] == 1


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
