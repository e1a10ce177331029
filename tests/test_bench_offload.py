"""The optimizer-offload arms of ``asynchzp-bench`` end to end: zero3-offload and asynchzp-offload on 4 CPU ranks in 2
nodes, at gradient accumulation 1 and 4. AsyncHZP copies each optimizer step's gradients to the host once, after
the window's cross-node sum, so its measured host<->device bytes do not grow with accumulation; stock ZeRO-3's
(the formula: its copies cannot be measured on CPU ranks) grow with every micro-step."""

from __future__ import annotations

import json

import pytest

from ds_asynchzp.bench import cli

GRAD_ACCUMS = (1, 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, deepspeed_cpu_ops):
    """results.json (and, at the larger accumulation, the report) of both arms at each accumulation."""
    out = {}
    for ga in GRAD_ACCUMS:
        path = tmp_path_factory.mktemp(f"offload_ga{ga}")
        # The report (plots) once, where it has the most to show.
        report = [] if ga == max(GRAD_ACCUMS) else ["--no-report"]
        code = cli.main(["--arms", "zero3-offload,asynchzp-offload", "--nproc", "4", "--node-size", "2",
                         "--model", "tiny", "--steps", "2", "--warmup-steps", "1", "--grad-accum", str(ga),
                         "--seq-len", "32", "--network", "loopback", "--out", str(path), "--timeout", "300",
                         *report])
        assert code == 0
        out[ga] = (json.loads((path / "results.json").read_text()), path)
    return out


def _copies(results: dict, arm: str) -> dict:
    """The host<->device figure the report shows for the arm, and the formula's."""
    figures = results["arms"][arm]["offload"]["host_device_bytes_per_step"]
    return {"shown": figures[figures["shown"]]["total"], "measured": figures["measured"],
            "predicted": figures["predicted"]["total"]}


def test_asynchzp_offload_copies_do_not_grow_with_accumulation(runs):
    measured = {ga: _copies(runs[ga][0], "asynchzp-offload")["measured"] for ga in GRAD_ACCUMS}
    assert all(m is not None and m["to_host"] > 0 and m["to_device"] > 0 for m in measured.values())
    assert measured[4]["total"] <= measured[1]["total"] * 1.001
    for ga in GRAD_ACCUMS:
        copies = _copies(runs[ga][0], "asynchzp-offload")
        assert copies["shown"] == copies["measured"]["total"]
        assert copies["measured"]["total"] == pytest.approx(copies["predicted"], rel=0.05)
    stock = {ga: _copies(runs[ga][0], "zero3-offload") for ga in GRAD_ACCUMS}
    # Stock's figure is its formula's (nothing measures its copies here), and grows with every micro-step.
    assert all(s["measured"] is None and s["shown"] == s["predicted"] for s in stock.values())
    assert stock[4]["shown"] > stock[1]["shown"]
    assert measured[4]["total"] <= 0.4 * stock[4]["shown"]


def test_offload_arms_train_alike_and_hold_their_states_on_the_host(runs):
    for ga in GRAD_ACCUMS:
        arms = runs[ga][0]["arms"]
        assert list(arms) == ["zero3-offload", "asynchzp-offload"]
        assert arms["zero3-offload"]["optimizer_class"] == "DeepSpeedZeroOptimizer_Stage3"
        assert "HierarchicalZeroOptimizer" in arms["asynchzp-offload"]["optimizer_class"]
        for arm, entry in arms.items():
            assert entry["host_optimizer_class"] == "DeepSpeedCPUAdam", arm
            host = entry["offload"]["host_bytes_per_rank"]
            assert host["measured"]["total"] == pytest.approx(host["predicted"]["total"], rel=0.01), arm
            assert host["measured"]["fp32_grad"] > 0
            assert entry["offload"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
        # Stock keeps its gradient partition on the host, AsyncHZP its gradient shard on the device.
        assert arms["zero3-offload"]["offload"]["host_bytes_per_rank"]["measured"]["grad_primary"] > 0
        assert arms["asynchzp-offload"]["offload"]["host_bytes_per_rank"]["measured"]["grad_primary"] == 0
        assert arms["asynchzp-offload"]["offload"]["device_bytes_per_rank"]["measured"]["grad_shard"] > 0
        for ours, reference in zip(arms["asynchzp-offload"]["losses"], arms["zero3-offload"]["losses"]):
            assert ours == pytest.approx(reference, rel=1e-6)


def test_report_and_summary_show_the_offload_figures(runs):
    results, path = runs[max(GRAD_ACCUMS)]
    report, summary = (path / "report.md").read_text(), (path / "summary.md").read_text()
    for text in (report, summary):
        table = text.split("host<->device MB/step |", 1)[1].split("\n\n", 1)[0]
        rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
        assert set(rows) == {"zero3-offload", "asynchzp-offload"}
        assert "not measurable" in rows["zero3-offload"] and "not measurable" not in rows["asynchzp-offload"]
        assert "not a measurement" in text and "there is no PCIe" in text
        assert '`offload_optimizer={"device": "cpu", "pin_memory": true}`' in text
    # Every arm's settings, the offload section included, are listed in the report.
    assert '`zero3-offload`: optimizer `DeepSpeedZeroOptimizer_Stage3`' in report
    assert 'overrides: `zero_optimization.offload_optimizer={"device": "cpu"}`' in report
