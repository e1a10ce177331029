"""The benchmark report: every number it prints comes from results.json, optional keys are used when present and
tolerated when absent, and the plots are real PNG files. Single-process, no ranks started."""

from __future__ import annotations

import copy
import json
import statistics

import pytest

pytest.importorskip("matplotlib")

from ds_asynchzp.bench import report  # noqa: E402  (after the skip: the report needs matplotlib)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOKENS_PER_STEP = 8 * 2 * 64 * 4
ENV = {"torch": "9.9.9+cpu", "deepspeed": "0.19.8", "ds_asynchzp": "0.1.0", "python": "3.11.7",
       "git_commit": "0123456789abcdef0123456789abcdef01234567", "host_cpus": 2, "date": "2026-01-02T03:04:05+00:00"}


def _arm(losses, step_times, intra, inter, by_op, peak_rss, state_total, optimizer):
    median = statistics.median(step_times[1:])  # over the steady steps, as the benchmark records it
    return {"losses": losses, "step_time_s": step_times, "median_step_time_s": median,
            "bytes_per_step": {"intra_node": intra, "inter_node": inter},
            "bytes_per_step_by_op": by_op, "collective_calls_per_step": 100.0,
            "peak_memory_bytes": peak_rss, "model_state_bytes": {"param_primary": state_total // 2,
                                                                 "master": state_total - state_total // 2,
                                                                 "total": state_total},
            "optimizer_class": optimizer, "tokens_per_s": TOKENS_PER_STEP / median}


def synthetic_results(optional: bool) -> dict:
    """Three arms on an 8-rank, 2-node layout; with `optional`, also the keys a repeated, emulated run adds."""
    base = [5.5, 4.9, 4.6, 4.5, 4.3]
    results = {
        "config": {"arms": ["zero3", "hpz", "asynchzp"], "nproc": 8, "node_size": 4, "world_size": 8, "num_nodes": 2,
                   "model": "small", "moe_experts": 0, "steps": 5, "grad_accum": 4, "micro_batch": 2, "seq_len": 64,
                   "dtype": "fp32", "seed": 1234, "lr": 1e-3, "weight_decay": 0.01, "gradient_clipping": 1.0,
                   "warmup_steps": 1, "zero_optimization": {"stage": 3, "overlap_comm": False},
                   "arm_overrides": {"hpz": {"zero_optimization.zero_hpz_partition_size": 4}},
                   "tokens_per_optimizer_step": TOKENS_PER_STEP},
        "env": dict(ENV),
        "arms": {
            "zero3": _arm(base, [5.0, 4.0, 4.2, 4.1, 4.3], 0.0, 50e6,
                          {"all_gather": {"intra_node": 0.0, "inter_node": 34e6},
                           "reduce_scatter": {"intra_node": 0.0, "inter_node": 16e6 - 14},
                           "all_reduce": {"intra_node": 0.0, "inter_node": 14.0}}, 400e6, 3_000_000,
                          "DeepSpeedZeroOptimizer_Stage3"),
            "hpz": _arm(list(base), [3.0, 2.8, 2.9, 3.1, 2.7], 25e6, 20e6,
                        {"all_gather": {"intra_node": 25e6, "inter_node": 4e6},
                         "reduce_scatter": {"intra_node": 0.0, "inter_node": 16e6}}, 410e6, 3_100_000,
                        "DeepSpeedZeroOptimizer_Stage3"),
            "asynchzp": _arm([v * (1 + 2e-8) for v in base], [3.3, 3.2, 3.4, 3.1, 3.5], 45e6, 2e6,
                             {"all_gather": {"intra_node": 30e6, "inter_node": 1e6},
                              "reduce_scatter": {"intra_node": 15e6, "inter_node": 1e6},
                              "recv": {"intra_node": 0.0, "inter_node": 0.0}}, 405e6, 5_500_000,
                             "HierarchicalZeroOptimizer"),
        },
    }
    if optional:
        results["config"]["network"] = {"mode": "emulated", "inter_node_bw": "200mbit", "inter_node_delay_ms": None,
                                        "mtu": 9000}
        results["config"]["repeats"] = 3
        for k, entry in enumerate(results["arms"].values()):
            medians = [entry["median_step_time_s"] * f for f in (1.0, 0.9, 1.1)]
            entry["repeats"] = [{"step_time_s": entry["step_time_s"], "median_step_time_s": m,
                                 "tokens_per_s_per_rank": TOKENS_PER_STEP / 8 / m,
                                 "wire_bytes_inter_node_per_step": 1e6, "comm_time_s": [0.5] * 5} for m in medians]
            entry["tokens_per_s_per_rank"] = {"min": 100.0 + k, "median": 120.0 + k}
            entry["step_time_stats_s"] = {"min": 2.0 + k, "median": 2.5 + k}
            entry["wire_bytes_inter_node_per_step"] = 12.5e6 + k * 1e6
            entry["link_bytes_inter_node_per_step"] = 12e6 + k * 1e6
            entry["exposed_comm_s_per_step"] = 0.75 + k
            entry["comm_busy_s_per_step"] = 1.5 + k
            entry["timeline"] = synthetic_timeline(threaded=entry["optimizer_class"] == "HierarchicalZeroOptimizer")
            entry["timeline_step"], entry["timeline_rank"] = 3, 0
        results["config"]["comm_delay_ms"] = 2.5
    return results


def synthetic_timeline(threaded: bool) -> dict:
    """A 3 s step: with `threaded`, collectives on two communication threads and one short wait; without, every
    collective on the training thread, each matched by a wait."""
    if threaded:
        collectives = [{"thread": "asynchzp-gather", "op": "all_gather", "tag": "asynchzp.param_gather",
                        "start": 0.1 * i, "end": 0.1 * i + 0.08, "inter_node": False} for i in range(20)]
        collectives += [{"thread": "asynchzp-reduce", "op": "reduce_scatter", "tag": "asynchzp.grad_reduce_scatter",
                         "start": 1.0 + 0.2 * i, "end": 1.1 + 0.2 * i, "inter_node": i == 9} for i in range(10)]
        waits = [{"start": 2.9, "end": 2.95, "what": "asynchzp-reduce"}]
    else:
        collectives = [{"thread": "MainThread", "op": "all_gather", "tag": "all_gather", "start": 0.3 * i,
                        "end": 0.3 * i + 0.1, "inter_node": True} for i in range(10)]
        waits = [{"start": c["start"], "end": c["end"], "what": "all_gather"} for c in collectives]
    return {"duration_s": 3.0, "collectives": collectives, "waits": waits}


def results_rows(text: str) -> dict:
    """{arm: {column: cell}} of the report's results table."""
    section = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split(" | ")]
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:]]
    return {row[0]: dict(zip(header, row)) for row in rows}


def assert_valid_pngs(out_dir, timelines: bool = True) -> None:
    for name in report.PLOTS:
        data = (out_dir / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        # Results without any timeline get a one-line placeholder figure, small but still a real PNG.
        floor = 2_000 if name == "timeline.png" and not timelines else 10_000
        assert len(data) > floor, f"{name} is only {len(data)} bytes: likely an empty figure"


@pytest.mark.parametrize("optional", [False, True], ids=["minimal-keys", "optional-keys"])
def test_report_states_provenance_workload_and_one_row_per_arm(tmp_path, optional):
    results = synthetic_results(optional)
    path = report.write_report(results, tmp_path)
    assert path == tmp_path / "report.md"
    text = path.read_text(encoding="utf-8")
    for value in ENV.values():
        assert str(value) in text
    assert "Network: " + ("emulated nodes" if optional else "not recorded") in text
    assert "200mbit" in text if optional else "200mbit" not in text
    assert f"**{TOKENS_PER_STEP:,} tokens per optimizer step, identical in every arm**" in text
    assert "Warning" not in text  # the synthetic arms are self-consistent
    assert "`zero_optimization.zero_hpz_partition_size=4`" in text
    assert ("repeats per arm: 3" if optional else "repeats per arm: 1 (no repeats recorded)") in text
    rows = results_rows(text)
    assert list(rows) == ["zero3", "hpz", "asynchzp"]
    for name in report.PLOTS:
        assert f"]({name})" in text  # embedded with a relative link
    assert_valid_pngs(tmp_path, timelines=optional)
    if optional:
        assert "Injected communication delay: 2.5 ms before and after each of the package's own collectives" in text
        assert "AsyncHZP arms only" in text and "Left out of the timeline" not in text
        assert report.DELAY_FOOTNOTE in text  # how the delay bends busy against exposed
    else:
        # No timelines and no recorded delay: both said, neither fails the report.
        assert "Injected communication delay: not recorded" in text
        assert "Left out of the timeline: `zero3`: no timeline recorded" in text
        assert report.DELAY_FOOTNOTE not in text


def test_ratios_and_bytes_are_computed_from_the_inputs(tmp_path):
    results = synthetic_results(optional=False)
    rows = results_rows(report.write_report(results, tmp_path).read_text(encoding="utf-8"))
    arms = results["arms"]
    for arm, row in rows.items():
        entry = arms[arm]
        assert row["inter ratio vs zero3"] == f"{entry['bytes_per_step']['inter_node'] / 50e6:.3f}"
        assert row["inter MB/step"] == f"{entry['bytes_per_step']['inter_node'] / 1e6:.3f}"
        assert row["intra MB/step"] == f"{entry['bytes_per_step']['intra_node'] / 1e6:.3f}"
        # Without repeats the spread is over the steady steps (warm-up step 1 excluded).
        steady = entry["step_time_s"][1:]
        assert row["step s min"] == f"{min(steady):.3f}"
        assert row["step s median"] == f"{entry['median_step_time_s']:.3f}"
        assert row["speed-up vs zero3"] == f"{arms['zero3']['median_step_time_s'] / entry['median_step_time_s']:.3f}"
        assert row["tokens/s/rank median"] == f"{entry['tokens_per_s'] / 8:.1f}"
        assert row["peak RSS MB"] == f"{entry['peak_memory_bytes'] / 1e6:.1f}"
        assert row["model-state MB"] == f"{entry['model_state_bytes']['total'] / 1e6:.3f}"
        # Measurements a loopback run lacks get no column at all.
        assert not {"link MB/step (counted)", "link MB/step (model)", "counted link ratio vs zero3", "exposed comm s/step", "comm busy s/step",
                    "in collectives s/step (older results)"} & set(row)
    assert rows["hpz"]["inter ratio vs zero3"] == "0.400"


def test_optional_keys_take_precedence_when_present(tmp_path):
    results = synthetic_results(optional=True)
    text = report.write_report(results, tmp_path).read_text(encoding="utf-8")
    rows = results_rows(text)
    for k, arm in enumerate(["zero3", "hpz", "asynchzp"]):
        row = rows[arm]
        assert row["tokens/s/rank min"] == f"{100.0 + k:.1f}"
        assert row["tokens/s/rank median"] == f"{120.0 + k:.1f}"
        assert row["step s min"] == f"{2.0 + k:.3f}"
        assert row["step s median"] == f"{2.5 + k:.3f}"
        assert row["speed-up vs zero3"] == f"{2.5 / (2.5 + k):.3f}"
        assert row["link MB/step (counted)"] == f"{12.5 + k:.3f}"
        assert row["counted link ratio vs zero3"] == f"{(12.5 + k) / 12.5:.3f}"
        assert row["link MB/step (model)"] == f"{12.0 + k:.3f}"
        assert row["exposed comm s/step"] == f"{0.75 + k:.3f}"
        assert row["comm busy s/step"] == f"{1.5 + k:.3f}"
        assert "in collectives s/step (older results)" not in row
    assert "training thread was blocked on communication" in text and "busy >> exposed" in text
    assert "maximum over ranks, since the slowest rank bounds the step" in text


def test_older_exposed_figure_is_not_shown_as_training_thread_time(tmp_path):
    # Results written before busy time was recorded held summed call durations under exposed_comm_s_per_step.
    results = synthetic_results(optional=True)
    for entry in results["arms"].values():
        del entry["comm_busy_s_per_step"]
    text = report.write_report(results, tmp_path).read_text(encoding="utf-8")
    rows = results_rows(text)
    assert "exposed comm s/step" not in rows["zero3"] and "comm busy s/step" not in rows["zero3"]
    assert rows["hpz"]["in collectives s/step (older results)"] == "1.750"
    assert "In collectives (older results)" in text


def test_repeats_without_summary_keys_give_the_spread_over_repeats(tmp_path):
    results = synthetic_results(optional=True)
    for entry in results["arms"].values():
        del entry["step_time_stats_s"], entry["tokens_per_s_per_rank"]
    rows = results_rows(report.write_report(results, tmp_path).read_text(encoding="utf-8"))
    median = results["arms"]["hpz"]["median_step_time_s"]
    assert rows["hpz"]["step s min"] == f"{median * 0.9:.3f}"
    assert rows["hpz"]["step s median"] == f"{median:.3f}"
    assert rows["hpz"]["tokens/s/rank min"] == f"{TOKENS_PER_STEP / 8 / (median * 1.1):.1f}"


def test_loss_parity_and_per_collective_bytes(tmp_path):
    text = report.write_report(synthetic_results(optional=False), tmp_path).read_text(encoding="utf-8")
    parity = text.split("## Loss parity", 1)[1].split("\n## ", 1)[0]
    hpz_row = next(line for line in parity.splitlines() if line.startswith("| hpz"))
    assert "0.00e+00" in hpz_row and "5/5" in hpz_row
    asynchzp_row = next(line for line in parity.splitlines() if line.startswith("| asynchzp"))
    assert "2.00e-08" in asynchzp_row and "0/5" in asynchzp_row
    by_op = text.split("## Bytes per collective kind", 1)[1].split("\n## ", 1)[0]
    # A 14-byte scalar all-reduce is not shown as zero; an op with no bytes is listed as such, not as a row.
    assert any(line.startswith("| zero3") and "all_reduce" in line and "<0.001" in line for line in by_op.splitlines())
    assert "asynchzp/recv" in by_op


def test_report_without_a_zero3_arm_marks_ratios_not_available(tmp_path):
    results = synthetic_results(optional=False)
    del results["arms"]["zero3"]
    rows = results_rows(report.write_report(results, tmp_path).read_text(encoding="utf-8"))
    assert rows["hpz"]["inter ratio vs zero3"] == rows["hpz"]["speed-up vs zero3"] == "n/a"
    assert_valid_pngs(tmp_path, timelines=False)


def test_warns_when_recorded_throughput_contradicts_the_tokens_per_step(tmp_path):
    results = synthetic_results(optional=False)
    results["arms"]["hpz"]["tokens_per_s"] *= 2
    assert "**Warning:** arm hpz" in report.write_report(results, tmp_path).read_text(encoding="utf-8")


def test_main_regenerates_the_report_from_a_results_file(tmp_path, capsys):
    source = tmp_path / "run" / "results.json"
    source.parent.mkdir()
    source.write_text(json.dumps(synthetic_results(optional=True)), encoding="utf-8")
    assert report.main([str(source), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.md").is_file()
    assert_valid_pngs(tmp_path / "out")
    assert report.main([str(source)]) == 0  # default: next to the results file
    assert (source.parent / "report.md").read_text() == (tmp_path / "out" / "report.md").read_text()
    assert "report.md" in capsys.readouterr().out


def test_archived_records_are_smaller_and_read_back_by_the_report_and_the_planner(tmp_path, capsys):
    """`python -m ds_asynchzp.bench.records archive DIR` gzips every results.json under DIR (deterministically);
    the report and the readers that name results.json find the .gz and read the same records."""
    from ds_asynchzp.bench import records

    results = synthetic_results(optional=True)
    for run in ("a", "b/sweep"):
        (tmp_path / run).mkdir(parents=True)
        (tmp_path / run / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    assert records.main(["archive", str(tmp_path)]) == 0
    archived = sorted(tmp_path.rglob("results.json*"))
    assert [p.name for p in archived] == ["results.json.gz", "results.json.gz"]
    assert "archived 2 results.json" in capsys.readouterr().out
    assert all(p.stat().st_size < len(json.dumps(results, indent=2)) / 3 for p in archived)
    assert records.read_results(tmp_path / "a" / "results.json") == results == records.read_results(archived[0])
    first = archived[0].read_bytes()
    (tmp_path / "a" / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    records.archive(tmp_path / "a")
    assert archived[0].read_bytes() == first                       # the same records, the same bytes
    assert report.main([str(archived[0]), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.md").is_file()
    with pytest.raises(SystemExit):
        records.main(["archive", str(tmp_path / "missing")])


def test_report_does_not_modify_its_input(tmp_path):
    results = synthetic_results(optional=True)
    before = copy.deepcopy(results)
    report.write_report(results, tmp_path)
    assert results == before


OVERRIDE_ARM = "asynchzp:param_shard_size=2"


def _layout(world, node, d_p, d_g, d_o, auto_reason=None):
    return {"world_size": world, "node_size": node, "num_nodes": world // node, "param_shard_size": d_p,
            "grad_shard_size": d_g, "optimizer_shard_size": d_o, "auto_reason": auto_reason}


def results_with_layouts() -> dict:
    """The synthetic run plus an override arm, each arm with its recorded layout and AsyncHZP's memory roles."""
    results = synthetic_results(optional=False)
    arms = results["arms"]
    arms["zero3"]["layout"] = _layout(8, 4, 8, 8, 8)
    arms["hpz"]["layout"] = _layout(8, 4, 4, 8, 8)
    arms["hpz"]["model_state_bytes"] = {"param_primary": 1_000_000, "param_secondary": 2_000_000,
                                        "grad_primary": 500_000, "master": 4_000_000, "total": 7_500_000}
    arms["asynchzp"]["layout"] = _layout(8, 4, 4, 4, 8)
    arms["asynchzp"]["layout_text"] = "async_hzp layout: world=8 (2 node(s) x 4 ranks); params sharded over 4"
    arms["asynchzp"]["model_state_bytes"] = {"param_shard": 1_500_000, "grad_shard": 1_500_000, "master": 1_000_000,
                                             "optimizer_state": 2_000_000, "total": 6_000_000}
    arms[OVERRIDE_ARM] = dict(copy.deepcopy(arms["asynchzp"]), layout=_layout(8, 4, 2, 2, 8, "fits 0.5 GB"),
                              model_state_bytes={"param_shard": 3_000_000, "grad_shard": 3_000_000,
                                                 "master": 1_000_000, "optimizer_state": 2_000_000,
                                                 "total": 9_000_000})
    results["config"]["arms"].append(OVERRIDE_ARM)
    results["config"]["arm_overrides"][OVERRIDE_ARM] = {"async_hzp": {"node_size": 4, "param_shard_size": 2}}
    return results


def section_rows(text: str, title: str) -> dict:
    """{arm: {column: cell}} of the first table under `## title`."""
    section = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    return table_rows(section)


def table_rows(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split(" | ")]
    return {row[0]: dict(zip(header, row)) for row in
            ([c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:])}


ROLES = ["param_primary", "param_secondary", "param_shard", "grad_primary", "grad_shard", "master", "optimizer_state"]


def test_report_names_each_arms_layout_and_memory_per_role(tmp_path):
    results = results_with_layouts()
    text = report.write_report(results, tmp_path).read_text(encoding="utf-8")
    assert list(results_rows(text)) == ["zero3", "hpz", "asynchzp", OVERRIDE_ARM]  # the spec names the arm

    layout = section_rows(text, "Layout")
    assert [layout[a]["d_p"] + "/" + layout[a]["d_g"] + "/" + layout[a]["d_o"] for a in layout] == [
        "8/8/8", "4/8/8", "4/4/8", "2/2/8"]
    assert (layout[OVERRIDE_ARM]["param replicas"], layout[OVERRIDE_ARM]["grad replicas"],
            layout[OVERRIDE_ARM]["optimizer replicas"]) == ("4", "4", "1")
    assert layout[OVERRIDE_ARM]["nodes x ranks"] == "2 x 4"
    assert "- `asynchzp`: async_hzp layout: world=8 (2 node(s) x 4 ranks); params sharded over 4\n" in text
    assert f"- `{OVERRIDE_ARM}`: async_hzp layout: world=8 (2 node(s) x 4 ranks); params sharded over 4; " \
           "\"auto\": fits 0.5 GB" in text
    assert f"- `{OVERRIDE_ARM}`: optimizer `HierarchicalZeroOptimizer`; layout d_p/d_g/d_o = 2/2/8 " \
           "(replicas 4/4/1); overrides: `async_hzp={\"node_size\": 4, \"param_shard_size\": 2}`" in text

    memory = section_rows(text, "Model-state memory")
    # The union of every arm's roles, in a fixed order, plus the total; 0 where an arm has no such role.
    assert list(memory["zero3"]) == ["arm", *ROLES, "total"]
    for arm, entry in results["arms"].items():
        state = entry["model_state_bytes"]
        for role in ROLES:
            assert memory[arm][role] == f"{state.get(role, 0) / 1e6:.3f}"
        assert memory[arm]["total"] == f"{state['total'] / 1e6:.3f}"
    assert memory["asynchzp"]["param_primary"] == "0.000" and memory["hpz"]["param_secondary"] == "2.000"
    assert_valid_pngs(tmp_path, timelines=False)


def test_summary_table_shows_layout_and_memory_per_role():
    from ds_asynchzp.bench.table import format_table

    results = results_with_layouts()
    summary = format_table(results)
    assert summary.splitlines()[2].startswith("| zero3")  # the comparison table still comes first
    rows = table_rows(summary.split("Layout and model-state memory per role", 1)[1])
    assert list(rows) == ["zero3", "hpz", "asynchzp", OVERRIDE_ARM]
    assert rows[OVERRIDE_ARM]["d_p/d_g/d_o"] == "2/2/8" and rows[OVERRIDE_ARM]["replicas p/g/o"] == "4/4/1"
    assert rows["hpz"]["d_p/d_g/d_o"] == "4/8/8" and rows["hpz"]["replicas p/g/o"] == "2/1/1"
    assert list(rows["zero3"])[3:] == [f"{r} MB" for r in ROLES] + ["model-state total MB"]
    assert rows[OVERRIDE_ARM]["param_shard MB"] == "3.000" and rows[OVERRIDE_ARM]["param_primary MB"] == "0.000"
    assert rows["hpz"]["model-state total MB"] == "7.500"


def test_runs_without_recorded_layouts_say_so():
    from ds_asynchzp.bench.table import format_table

    rows = table_rows(format_table(synthetic_results(optional=False)).split("per role", 1)[1])
    assert rows["zero3"]["d_p/d_g/d_o"] == "n/a"


def test_summary_table_shows_exposed_and_busy_communication():
    from ds_asynchzp.bench.table import format_table

    summary = format_table(synthetic_results(optional=True))
    rows = table_rows(summary.split("\n\n", 1)[0])
    assert [rows[a]["exposed comm s/step"] for a in rows] == ["0.750", "1.750", "2.750"]
    assert [rows[a]["comm busy s/step"] for a in rows] == ["1.500", "2.500", "3.500"]
    assert "busy >> exposed" in summary
    # Without busy time the exposed figure is an older meaning: not shown under the new name.
    results = synthetic_results(optional=True)
    for entry in results["arms"].values():
        del entry["comm_busy_s_per_step"]
    older = table_rows(format_table(results).split("\n\n", 1)[0])
    assert older["hpz"]["exposed comm s/step"] == older["hpz"]["comm busy s/step"] == "n/a"


def results_with_offload() -> dict:
    """The synthetic run plus the two offload arms, with what their workers record (the figures of a real run of
    the small model on 8 ranks would be these formulas' exactly)."""
    from ds_asynchzp.bench.offload import add_offload_figures, predicted_figures

    results = synthetic_results(optional=False)
    arms = results["arms"]
    for arm, twin, layout in (("zero3-offload", "zero3", _layout(8, 4, 8, 8, 8)),
                              ("asynchzp-offload", "asynchzp", _layout(8, 4, 4, 4, 8))):
        arms[arm] = dict(copy.deepcopy(arms[twin]), layout=layout)
        results["config"]["arms"].append(arm)
        predicted = predicted_figures(results, arm)
        host = {("grad_primary" if r == "grad_shard" else r): v for r, v in predicted["host"].items()}
        arms[arm]["host_state_bytes"] = {"grad_primary": 0, **host}
        arms[arm]["model_state_bytes"] = {**{r: v for r, v in host.items() if r != "fp32_grad"},
                                          **{r: v for r, v in predicted["device"].items()}}
        arms[arm]["model_state_bytes"]["total"] = sum(v for r, v in arms[arm]["model_state_bytes"].items()
                                                      if r != "total")
        # Stock's copies are not recorded on CPU ranks: the ledger saw none.
        arms[arm]["host_device_bytes_per_step"] = ({"to_host": 0.0, "to_device": 0.0, "total": 0.0}
                                                   if arm == "zero3-offload" else predicted["host_device"])
        add_offload_figures(results, arm)
    return results


def test_offload_section_shows_measured_copies_next_to_the_formula(tmp_path):
    results = results_with_offload()
    arms = results["arms"]
    assert "offload" not in arms["zero3"] and "offload" not in arms["asynchzp"]
    text = report.write_report(results, tmp_path).read_text(encoding="utf-8")
    section = text.split("## Optimizer offload", 1)[1].split("\n## ", 1)[0]
    rows = table_rows(section)
    assert list(rows) == ["zero3-offload", "asynchzp-offload"]
    stock = arms["zero3-offload"]["offload"]["host_device_bytes_per_step"]
    ours = arms["asynchzp-offload"]["offload"]["host_device_bytes_per_step"]
    assert stock["measured"] is None and stock["shown"] == "predicted"
    total = f"{stock['predicted']['total'] / 1e6:.3f}"
    assert rows["zero3-offload"]["host<->device MB/step"] == f"{total} (formula; not measurable)"
    assert rows["asynchzp-offload"]["host<->device MB/step"] == (
        f"{ours['measured']['total'] / 1e6:.3f} (formula {ours['predicted']['total'] / 1e6:.3f})")
    # 4 micro-steps, fp32, d_o = N: (4 + 4) / (2·4·4 + 4 + 4) of stock's bytes.
    assert rows["asynchzp-offload"]["vs zero3-offload"] == "0.200"
    assert "grad_shard" in rows["zero3-offload"]["host by role MB"]
    assert "grad_shard" not in rows["asynchzp-offload"]["host by role MB"]
    assert "not a measurement" in section and "there is no PCIe" in section and "favours zero3-offload" in section
    # Without offload arms, no section.
    del arms["zero3-offload"], arms["asynchzp-offload"]
    assert "## Optimizer offload" not in report.write_report(results, tmp_path).read_text(encoding="utf-8")


def test_package_buffers_table_shows_each_kind_its_total_and_the_model_states(tmp_path):
    results = synthetic_results(optional=False)
    buffers = {"gathered_params_owned": 4_000_000, "gathered_params_in_use": 500_000,
               "gathered_params_peak_in_use": 3_000_000, "grad_staging": 2_000_000, "gather_scratch": 1_500_000,
               "reduce_scratch": 250_000, "boundary_scratch": 125_000, "error_feedback": 1_000_000,
               "host_copy_staging": 0}
    buffers["total"] = sum(v for k, v in buffers.items() if "in_use" not in k)          # 8.875 MB
    ours = results["arms"]["asynchzp"]
    ours["package_buffer_bytes"] = buffers
    ours["package_buffer_bytes_total_by_rank"] = [buffers["total"], buffers["total"] + 125_000]
    # The residual is a model-state role too: the table counts it among the buffers, not twice.
    ours["model_state_bytes"] = dict(ours["model_state_bytes"], error_feedback=1_000_000,
                                     total=ours["model_state_bytes"]["total"] + 1_000_000)
    text = report.write_report(results, tmp_path).read_text(encoding="utf-8")
    rows = section_rows(text, "Package buffers per rank")
    assert list(rows) == ["asynchzp"]                 # stock arms record none
    row = rows["asynchzp"]
    assert row["gather pool owned MB"] == "4.000" and row["pool peak in use MB"] == "3.000"
    assert row["pool in use MB"] == "0.500" and row["grad staging ring MB"] == "2.000"
    assert (row["gather scratch MB"], row["reduce scratch MB"], row["boundary scratch MB"]) == (
        "1.500", "0.250", "0.125")
    assert row["error feedback MB"] == "1.000" and row["host-copy fp32 MB"] == "0.000"
    assert row["total MB"] == "8.875" and row["total, largest rank MB"] == "9.000"
    assert row["model states MB"] == "5.500" and row["buffers / model states"] == f"{8.875 / 5.5:.3f}"
    section = text.split("## Package buffers per rank", 1)[1].split("\n## ", 1)[0]
    assert "trimmed once per step" in section and "Not shown: zero3, hpz" in section
    # Results that predate the figure: no section.
    del ours["package_buffer_bytes"]
    assert "## Package buffers" not in report.write_report(results, tmp_path).read_text(encoding="utf-8")


def test_summary_leads_with_the_bytes_counted_on_the_links(tmp_path):
    """The opening paragraph's bytes ratio is the one counted on the emulated node links, with the model's beside
    it; a run that counted nothing (loopback) gives the model's link figure and says so; a run with neither gives
    the ring model's bytes and says that no link figure was recorded."""
    emulated = synthetic_results(optional=True)
    summary = report.write_report(emulated, tmp_path / "e").read_text(encoding="utf-8").split("\n")[2]
    arms = emulated["arms"]
    counted = arms["asynchzp"]["wire_bytes_inter_node_per_step"] / arms["zero3"]["wire_bytes_inter_node_per_step"]
    model = arms["asynchzp"]["link_bytes_inter_node_per_step"] / arms["zero3"]["link_bytes_inter_node_per_step"]
    assert f"Its node links carried {counted:.2f}x ZeRO-3's bytes, counted on the links" in summary
    assert f"the model predicts {model:.2f}x" in summary and "one link per node, shared by its ranks" in summary
    loopback = synthetic_results(optional=True)
    for entry in loopback["arms"].values():
        entry["wire_bytes_inter_node_per_step"] = None
    summary = report.write_report(loopback, tmp_path / "l").read_text(encoding="utf-8").split("\n")[2]
    assert f"Nothing was counted on links in this run; by the model its node links would carry {model:.2f}x" in summary
    plain = report.write_report(synthetic_results(optional=False), tmp_path / "p").read_text(encoding="utf-8")
    assert "It sent 0.04x ZeRO-3's bytes in collectives whose group spans nodes" in plain.split("\n")[2]
    assert "no link figure was recorded" in plain.split("\n")[2]


def test_node_links_table_lists_every_counted_link_and_names_the_topology(tmp_path):
    results = synthetic_results(optional=True)
    results["config"]["network"]["topology"] = "rails"
    for k, entry in enumerate(results["arms"].values()):
        entry["wire_bytes_by_link_per_step"] = {f"node{n}/eth{i}": (k + 1) * 1e6 + n * 1e5 + i * 1e4
                                                for n in range(2) for i in range(4)}
    text = report.write_report(results, tmp_path).read_text(encoding="utf-8")
    assert "one link per rank (rails" in text.split("\n")[2]
    section = text.split("## Node links", 1)[1].split("\n## ", 1)[0]
    header = [c.strip() for c in next(line for line in section.splitlines() if line.startswith("|")).strip("|").split("|")]
    assert header == ["arm", *(f"node{n}/eth{i}" for n in range(2) for i in range(4)), "busiest"]
    asynchzp = next(line for line in section.splitlines() if line.startswith("| asynchzp"))
    cells = [c.strip() for c in asynchzp.strip("|").split("|")]
    assert cells[1] == "3.000" and cells[-1] == f"{3.13:.3f}"
    # A run that counted nothing per link has no such section.
    plain = report.write_report(synthetic_results(optional=True), tmp_path / "p").read_text(encoding="utf-8")
    assert "## Node links" not in plain
