"""The report's timeline plot: lanes per issuing thread, interval arithmetic, and a real PNG that shows the waits.
Synthetic timelines only; no ranks started."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from ds_asynchzp.bench import report, timeline_plot  # noqa: E402  (after the skip: plotting needs matplotlib)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WAIT_RGB = (0xD6, 0x27, 0x28)  # tab:red, the colour of the training thread's waits


def _collective(thread, tag, start, end, inter=False):
    return {"thread": thread, "op": tag.rsplit(".", 1)[-1], "tag": tag, "start": start, "end": end,
            "inter_node": inter}


def three_thread_timeline(waits: bool = True) -> dict:
    """A 2 s step: collectives on the training thread and on two communication threads, some inter-node."""
    collectives = [_collective("asynchzp-reduce", "asynchzp.grad_reduce_scatter", 1.0 + 0.1 * i, 1.08 + 0.1 * i,
                               inter=i % 2 == 0) for i in range(8)]
    collectives += [_collective("asynchzp-gather", "asynchzp.param_gather", 0.05 * i, 0.05 * i + 0.04)
                    for i in range(30)]
    collectives.append(_collective("MainThread", "asynchzp.modified_parameter", 1.9, 1.95, inter=True))
    return {"duration_s": 2.0, "collectives": collectives,
            "waits": [{"start": 1.9, "end": 1.95, "what": "all_reduce"},
                      {"start": 0.5, "end": 0.7, "what": "asynchzp-gather"}] if waits else []}


def _red_pixels(path) -> int:
    from matplotlib.image import imread

    pixels = (imread(path)[..., :3] * 255).round().astype(int)
    close = (abs(pixels - WAIT_RGB) <= 6).all(axis=-1)
    return int(close.sum())


def test_lanes_put_the_training_thread_first_then_the_communication_threads():
    timeline = three_thread_timeline()
    timeline["collectives"].append(_collective("some-helper", "all_reduce", 0.0, 0.1))
    assert timeline_plot.thread_lanes(timeline) == ["MainThread", "asynchzp-gather", "asynchzp-reduce",
                                                    "some-helper"]
    assert timeline_plot.thread_lanes({"duration_s": 1.0, "collectives": [], "waits": []}) == []


def test_union_counts_overlapping_intervals_once():
    assert timeline_plot.union_seconds([]) == 0.0
    assert timeline_plot.union_seconds([(0.0, 1.0), (0.5, 1.5), (2.0, 2.5)]) == pytest.approx(2.0)
    assert timeline_plot.union_seconds([(0.0, 3.0), (1.0, 2.0)]) == pytest.approx(3.0)  # nested


def test_a_tag_keeps_its_colour_across_arms():
    colors = timeline_plot.tag_colors([three_thread_timeline(),
                                       {"collectives": [_collective("MainThread", "all_gather", 0, 1)]}])
    assert list(colors) == ["all_gather", "asynchzp.grad_reduce_scatter", "asynchzp.modified_parameter",
                            "asynchzp.param_gather"]
    assert len(set(colors.values())) == len(colors)
    assert timeline_plot.WAIT_COLOR not in colors.values() and "tab:red" not in colors.values()


def test_plot_of_three_threads_is_a_real_png_that_shows_the_waits(tmp_path):
    arms = {"asynchzp": {"timeline": three_thread_timeline(), "timeline_step": 4, "timeline_rank": 0},
            "asynchzp-sync": {"timeline": three_thread_timeline(waits=False), "timeline_step": 4}}
    path = tmp_path / "timeline.png"
    assert timeline_plot.plot_timelines(arms, path) == []  # every arm drawn, nothing left out
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 30_000, f"only {len(data)} bytes: the lanes were not drawn"
    with_waits = _red_pixels(path)
    assert with_waits > 500  # 0.25 s of waits over a 2 s axis about 1000 px wide, plus the legend's swatch

    # The same plot without any wait has only the legend's red swatch left.
    for entry in arms.values():
        entry["timeline"]["waits"] = []
    timeline_plot.plot_timelines(arms, path)
    assert _red_pixels(path) < with_waits / 3


def test_arms_without_a_timeline_are_skipped_with_a_note(tmp_path):
    path = tmp_path / "timeline.png"
    arms = {"zero3": {"losses": [1.0]}, "hpz": {"timeline": None},
            "asynchzp": {"timeline": three_thread_timeline(), "timeline_step": 1}}
    notes = timeline_plot.plot_timelines(arms, path)
    assert [n.split(":", 1)[0] for n in notes] == ["`zero3`", "`hpz`"]
    assert path.read_bytes()[:8] == PNG_MAGIC

    # Nothing to draw at all: a placeholder figure, so a stale timeline.png of another run is overwritten.
    path.write_bytes(b"stale")
    notes = timeline_plot.plot_timelines({"zero3": {}}, path)
    assert len(notes) == 1 and path.read_bytes()[:8] == PNG_MAGIC


def test_report_embeds_the_timeline_and_says_what_to_look_for(tmp_path):
    from tests.test_bench_report import synthetic_results

    results = synthetic_results(optional=False)
    results["arms"]["asynchzp"].update(timeline=three_thread_timeline(), timeline_step=3, timeline_rank=0)
    text = report.write_report(results, tmp_path).read_text(encoding="utf-8")
    assert "timeline.png" in report.PLOTS
    assert "](timeline.png)" in text and report.TIMELINE_GUIDE in text
    assert "Left out of the timeline: `zero3`: no timeline recorded" in text and "`hpz`: no timeline" in text
    assert "`asynchzp`: no timeline" not in text
    assert len((tmp_path / "timeline.png").read_bytes()) > 20_000
