"""The bandwidth sweep's pieces without a cluster: rate lists, the planner's time model and its check (which must
fail on a planted mismatch), the sweep table, and the flow of each collective in ZeRO++'s volume table."""

from __future__ import annotations

import json

import pytest

from ds_asynchzp.formulas import flows
from ds_asynchzp.bench import cli, plan_check, sweep
from ds_asynchzp.planner import cli as plan_cli
from ds_asynchzp.planner import time_model


def test_rate_lists_are_checked_before_anything_runs(capsys):
    assert sweep.parse_rates("50mbit, 1gbit,unlimited") == ["50mbit", "1gbit", "unlimited"]
    for bad in ("", "50mbit,50mbit", "50mbit,fast"):
        with pytest.raises(ValueError):
            sweep.parse_rates(bad)
    with pytest.raises(SystemExit):
        cli.parse_args(["--network", "loopback", "--inter-node-bw", "50mbit,1gbit"])  # nothing to shape
    assert "needs --network emulated" in capsys.readouterr().err


def test_time_model_waits_for_the_link_on_the_training_thread_and_hides_a_micro_step_on_threads():
    link = time_model.link_seconds(1e6, 4, 100e6, overhead=1.0)  # 4 MB per node at 100 Mbit/s
    assert link == pytest.approx(0.32)
    assert time_model.predicted_step_s("zero3", 1.0, link, 4) == pytest.approx(1.32)
    # Host-bound collectives (0.5 s unshaped): between the link entirely under the host's work (1.0) and none of it
    # (1.32), the midpoint.
    assert time_model.step_bounds_s("zero3", 1.0, link, 4, unshaped_exposed_s=0.5) == pytest.approx((1.0, 1.32))
    assert time_model.predicted_step_s("zero3", 1.0, link, 4, unshaped_exposed_s=0.5) == pytest.approx(1.16)
    assert time_model.predicted_step_s("zero3", 1.0, link, 4, unshaped_exposed_s=0.1) == pytest.approx(1.27)
    assert time_model.predicted_step_s("asynchzp-sync", 1.0, link, 4) == pytest.approx(1.32)
    assert time_model.predicted_step_s("asynchzp", 1.0, link, 4) == pytest.approx(1.07)
    assert time_model.step_bounds_s("asynchzp", 1.0, link, 4) == pytest.approx((1.07, 1.32))
    assert time_model.predicted_step_s("asynchzp-q", 1.0, 0.1, 4) == pytest.approx(1.0)
    assert time_model.link_seconds(1e6, 4, None) == 0.0
    # Only the cross-node share of the exposure meets the link: waits inside a node stay in both bounds.
    assert time_model.step_bounds_s("hpz", 1.0, link, 4, unshaped_exposed_s=0.5,
                                    crossing_share=0.4) == pytest.approx((1.0 - 0.2 + 0.32, 1.32))


def test_cross_node_share_counts_waits_while_a_cross_node_collective_is_in_flight():
    timeline = {"waits": [{"start": 0.0, "end": 1.0}, {"start": 2.0, "end": 3.0}, {"start": 2.5, "end": 3.5}],
                "collectives": [
                    {"thread": "MainThread", "inter_node": True, "start": 0.5, "end": 2.25},    # 0.5 + 0.25
                    {"thread": "MainThread", "inter_node": False, "start": 3.0, "end": 3.5},   # inside a node
                    {"thread": "asynchzp-boundary", "inter_node": True, "start": 3.0, "end": 3.5}]}  # a thread's
    # Waits: [0, 1] and [2, 3.5], 2.5 s; while crossing: [0.5, 1] and [2, 2.25].
    assert time_model.cross_node_share(timeline) == pytest.approx(0.75 / 2.5)
    assert time_model.cross_node_share(None) == 1.0
    assert time_model.cross_node_share({"waits": [], "collectives": []}) == 1.0


def _fake_sweep(monkeypatch, measured_100: dict) -> dict:
    """Two rates; link bytes per rank from the unshaped run's ledger figure."""
    def results(times):
        return {"config": {"node_size": 2, "grad_accum": 4, "tokens_per_optimizer_step": 1000,
                           "zero3_knobs": "tuned", "arm_overrides": {}},
                "arms": {arm: {"median_step_time_s": t, "link_bytes_inter_node_per_step": 1.25e6}
                         for arm, t in times.items()}}
    monkeypatch.setattr("ds_asynchzp.bench.plan_check.check_results",
                        lambda res: {"link_bytes_per_rank": {}, "wire_overhead_factor": 1.0})
    return {"rates": ["unlimited", "100mbit"], "runs": {}, "reference_arm": "zero3",
            "results": {"unlimited": results({"zero3": 1.0, "asynchzp": 0.8}), "100mbit": results(measured_100)}}


def test_time_check_passes_a_matching_sweep_and_fails_a_planted_mismatch(monkeypatch):
    # 2 ranks x 1.25 MB = 2.5 MB per node: 0.2 s at 100 Mbit/s; asynchzp hides up to 0.2 s (a micro-step).
    good = plan_check.check_sweep(_fake_sweep(monkeypatch, {"zero3": 1.2, "asynchzp": 0.8}))
    assert good["ok"] and {r["arm"]: round(r["predicted"], 6) for r in good["rows"]} == {"zero3": 1.2, "asynchzp": 0.8}
    planted = plan_check.check_sweep(_fake_sweep(monkeypatch, {"zero3": 1.2, "asynchzp": 1.2}))
    assert not planted["ok"] and [r["arm"] for r in planted["rows"] if not r["ok"]] == ["asynchzp"]
    table = sweep.format_sweep(_fake_sweep(monkeypatch, {"zero3": 1.2, "asynchzp": 1.2}))
    assert "| 100mbit | 833 (1.00x) | 833 (1.00x) |" in table and "MISS" in table
    no_base = _fake_sweep(monkeypatch, {"zero3": 1.2, "asynchzp": 0.8})
    del no_base["results"]["unlimited"]
    assert not plan_check.check_sweep(no_base)["ok"]


def test_plan_check_reads_a_sweep(tmp_path, monkeypatch, capsys):
    fake = _fake_sweep(monkeypatch, {"zero3": 1.2, "asynchzp": 0.8})
    for rate, res in fake["results"].items():
        (tmp_path / sweep.rate_dir(rate)).mkdir()
        (tmp_path / sweep.rate_dir(rate) / "results.json").write_text(json.dumps(res))
    (tmp_path / "sweep.json").write_text(json.dumps({"rates": fake["rates"], "reference_arm": "zero3",
                                                     "runs": {r: f"{sweep.rate_dir(r)}/results.json"
                                                              for r in fake["rates"]}}))
    monkeypatch.setattr("ds_asynchzp.bench.plan_check.check_results",
                        lambda res: {"ok": True, "rows": [], "notes": [], "link_bytes_per_rank": {},
                                     "wire_overhead_factor": 1.0})
    monkeypatch.setattr(plan_cli, "format_check", lambda report, path: f"bytes {path}")
    assert plan_cli.main(["--check", str(tmp_path / "sweep.json")]) == 0
    printed = capsys.readouterr().out
    assert "PASS: every step time" in printed and "[100mbit]" in printed


@pytest.mark.parametrize("op, tag, phase, flow", [
    ("all_gather", "", "forward", flows.FORWARD_GATHER),
    ("all_gather", "", "backward", flows.BACKWARD_GATHER),
    ("reduce_scatter", "", "backward", flows.GRADIENT_REDUCTION),
    ("all_to_all", "", "backward", flows.GRADIENT_REDUCTION),       # stock qgZ
    ("all_reduce", "", "step", flows.OTHER),                         # the gradient norm
    ("all_gather", "asynchzp.param_gather", "backward", flows.BACKWARD_GATHER),
    ("all_gather", "asynchzp.expert.param_gather", "forward", flows.FORWARD_GATHER),
    ("reduce_scatter", "asynchzp.grad_reduce_scatter", "backward", flows.GRADIENT_REDUCTION),
    ("all_to_all", "asynchzp.boundary_grad", "step", flows.GRADIENT_REDUCTION),
    ("all_reduce", "asynchzp.boundary_allreduce", "forward", flows.GRADIENT_REDUCTION),
    ("all_gather", "asynchzp.param_refresh", "forward", flows.PARAMETER_REFRESH),
    ("all_gather", "asynchzp.bucket_check", "backward", flows.OTHER),
])
def test_every_collective_has_one_flow(op, tag, phase, flow):
    assert flows.flow_of(op, tag, phase) == flow


def test_a_sweep_without_the_reference_arm_writes_its_table_and_skips_the_plot(tmp_path, monkeypatch, capsys):
    """An A/B of two AsyncHZP arms at several rates (no zero3 to plot a speed-up over) ends cleanly."""
    import argparse

    fake = _fake_sweep(monkeypatch, {"asynchzp": 0.8, "asynchzp:param_shard_size=1": 0.9})
    del fake["results"]["unlimited"]["arms"]["zero3"]

    def run_one(args):
        rate = "unlimited" if args.inter_node_bw == "unlimited" else "100mbit"
        (tmp_path / sweep.rate_dir(args.inter_node_bw)).mkdir()
        (tmp_path / sweep.rate_dir(args.inter_node_bw) / "results.json").write_text(json.dumps(fake["results"][rate]))

    args = argparse.Namespace(out=str(tmp_path), inter_node_bws=["100mbit", "unlimited"], no_report=False)
    sweep.run_sweep(args, run_one)
    assert (tmp_path / "sweep.md").exists() and not (tmp_path / "speedup_vs_bandwidth.png").exists()
    assert "no speed-up plot" in capsys.readouterr().out
