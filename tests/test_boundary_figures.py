"""The offload step boundary's figures (`measure/boundary.py`), their aggregation over ranks and steps
(`bench/aggregate.py`), the report's table (`bench/boundary_table.py`) and the timeline's phase lanes."""

from __future__ import annotations

import pytest

from ds_asynchzp.bench.aggregate import aggregate_arm, merge_repeats
from ds_asynchzp.bench.boundary_table import format_boundary_table
from ds_asynchzp.measure.boundary import boundary_record, union_seconds
from tests.test_bench_cli import _fake_rank


def test_union_counts_overlaps_once_and_gaps_not_at_all():
    assert union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.5)]) == pytest.approx(3.0)
    assert union_seconds([]) == 0.0


def test_the_critical_path_is_the_sum_tail_the_last_copy_out_the_rest_the_host_step_and_the_last_copy_back():
    # Window [10, 20): sums 10-14 (two chunks), their copies 12-12.5 and 14-14.25, host pieces 15-16 and 16-17 on the
    # training thread, copies back 16-16.5 and 17-17.5, a refresh 16.5-19 on the boundary thread.
    phases = [(10.0, 12.0, "sum", "b"), (12.0, 14.0, "sum", "b"), (12.0, 12.5, "copy_out", "b"),
              (14.0, 14.25, "copy_out", "b"), (15.0, 16.0, "host_step", "M"), (16.0, 17.0, "host_step", "M"),
              (16.0, 16.5, "copy_back", "M"), (17.0, 17.5, "copy_back", "M"), (16.5, 19.0, "refresh", "b")]
    record = boundary_record(10.0, 20.0, phases, chunks=2)
    assert record["wall_s"] == 10.0
    assert record["phase_s"] == {"sum": 4.0, "copy_out": 0.75, "host_step": 2.0, "copy_back": 1.0, "refresh": 2.5}
    # Nothing ran in 14.25-15 and 19-20.
    assert record["other_s"] == pytest.approx(1.75)
    # 4 (sum) + 0.25 (last copy out) + 1.75 (other) + 2 (host) + 1.0 / 2 (copy back of the last of 2 pieces).
    assert record["critical_path_s"] == pytest.approx(8.5)
    assert boundary_record(10.0, 20.0, phases, chunks=None)["critical_path_s"] is None


def _ranks_with_boundaries(walls, paths):
    ranks = [_fake_rank(r, [1.0] * 3, [2.0] * 3, [1.0] * 3, 10) for r in range(2)]
    for r, rank in enumerate(ranks):
        for s, step in enumerate(rank["steps"]):
            phases = {k: 0.1 * (r + 1) for k in ("sum", "copy_out", "host_step", "copy_back", "refresh")}
            step["boundary"] = {"wall_s": walls[r][s], "critical_path_s": paths[r][s], "phase_s": phases,
                                "other_s": 0.01, "chunks": 4}
    return ranks


def test_boundary_figures_take_the_slowest_rank_per_step_then_the_median_of_steady_steps():
    ranks = _ranks_with_boundaries(walls=[[9.0, 1.0, 3.0], [5.0, 2.0, 2.0]], paths=[[9.0, 0.5, 1.0], [1.0, 1.0, 2.5]])
    entry = aggregate_arm(ranks, 1, 0)
    assert entry["boundary_wall_s"] == 2.5                  # max over ranks: 2, 3; median 2.5 (step 1 left out)
    assert entry["boundary_critical_path_s"] == 1.75        # max over ranks: 1, 2.5
    assert entry["boundary_phase_s"]["host_step"] == pytest.approx(0.2)
    assert entry["boundary_chunks"] == 4
    merged = merge_repeats([entry, dict(entry, boundary_wall_s=3.5)])
    assert merged["boundary_wall_s"] == 3.0 and merged["repeats"][1]["boundary_wall_s"] == 3.5
    # A step without a boundary on some rank (stock without offload): no figure rather than a wrong one.
    del ranks[0]["steps"][2]["boundary"]
    assert aggregate_arm(ranks, 1, 0)["boundary_wall_s"] is None


def test_the_table_compares_each_wall_with_the_whole_steps_critical_path():
    def entry(wall, path, step):
        return {"boundary_wall_s": wall, "boundary_critical_path_s": path, "median_step_time_s": step,
                "boundary_phase_s": {"sum": 1.0, "copy_out": 0.1, "host_step": 0.5, "copy_back": 0.2,
                                     "refresh": 0.3}, "boundary_other_s": 0.05, "offload": {}}
    results = {"config": {"gradient_clipping": 1.0, "arm_specs": {
        "asynchzp-offload": {"base": "asynchzp-offload", "overrides": {}},
        "asynchzp-offload:offload_pipeline=false": {"base": "asynchzp-offload",
                                                    "overrides": {"offload_pipeline": False}},
        "asynchzp": {"base": "asynchzp", "overrides": {}}}},
        "arms": {"asynchzp-offload": entry(2.2, 2.1, 5.0),
                 "asynchzp-offload:offload_pipeline=false": entry(2.4, 2.0, 5.1),
                 "asynchzp": {"median_step_time_s": 4.9}}}
    lines = format_boundary_table(results)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines
            if line.startswith("| asynchzp")}
    assert rows["asynchzp-offload"][:5] == ["host, in pieces", "5.000", "2.200", "2.100", "1.100"]
    assert rows["asynchzp-offload:offload_pipeline=false"][0] == "host, whole"
    assert rows["asynchzp-offload:offload_pipeline=false"][4] == "1.200"
    assert rows["asynchzp"][:3] == ["on the device", "4.900", "n/a"]
    assert format_boundary_table({"arms": {"zero3": {"median_step_time_s": 1.0}}}) == []


def test_the_timeline_gives_each_boundary_phase_a_lane(tmp_path):
    pytest.importorskip("matplotlib")
    from ds_asynchzp.bench import timeline_plot
    from tests.test_bench_timeline import three_thread_timeline

    timeline = three_thread_timeline()
    timeline["boundary_phases"] = [{"kind": "host_step", "thread": "MainThread", "start": 1.0, "end": 1.4},
                                   {"kind": "sum", "thread": "asynchzp-boundary", "start": 0.5, "end": 0.9}]
    assert timeline_plot.phase_lanes(timeline) == ["sum", "host_step"]     # in the phases' order
    path = tmp_path / "timeline.png"
    assert timeline_plot.plot_timelines({"asynchzp-offload": {"timeline": timeline, "timeline_step": 2}}, path) == []
    assert path.stat().st_size > 30_000


def test_reaggregate_rebuilds_an_arm_from_its_rank_records(tmp_path):
    """A run's arm entries again from the rank records under its logs: the figures the aggregation adds appear, and
    what it had is kept."""
    import json

    from ds_asynchzp.bench.reaggregate import reaggregate

    ranks = _ranks_with_boundaries(walls=[[9.0, 1.0, 3.0], [5.0, 2.0, 2.0]], paths=[[9.0, 0.5, 1.0], [1.0, 1.0, 2.5]])
    for repeat in (1, 2):
        workdir = tmp_path / "logs" / f"asynchzp-{repeat}"
        workdir.mkdir(parents=True)
        for rank in ranks:
            (workdir / f"rank{rank['rank']}.result.json").write_text(json.dumps({"ok": True, "result": rank}))
    old = {"median_step_time_s": 2.0, "wall_time_s": 12.5}
    (tmp_path / "results.json").write_text(json.dumps({
        "config": {"nproc": 2, "warmup_steps": 1, "tokens_per_optimizer_step": 0}, "arms": {"asynchzp": old}}))
    assert reaggregate(tmp_path) == ["asynchzp"]
    entry = json.loads((tmp_path / "results.json").read_text())["arms"]["asynchzp"]
    assert entry["boundary_wall_s"] == 2.5 and len(entry["repeats"]) == 2 and entry["wall_time_s"] == 12.5
    # Each rank's wall less its own sums (0.1 and 0.2 s): steps 2 and 3 give max(0.9, 1.8) and max(2.9, 1.8).
    assert entry["boundary_after_exchange_s"] == pytest.approx((1.8 + 2.9) / 2)
