"""The report's ``timeline.png``: one optimizer step of one rank, per arm, drawn interval by interval.

Each arm gets a subplot (stacked, one shared time axis in seconds from the step's start). Its top lane is the
training thread: the whole step as compute, with the stretches it spent blocked on communication drawn over it.
Below come one lane per thread that issued collectives (the training thread's own collectives first, then the
communication threads), each collective a bar from issue to completion, coloured by its ledger tag and hatched
when its group spans nodes; under optimizer offload, then one lane per phase of the step boundary (the cross-node
sum, the copies to the host, the host step, the copies back, the refresh: `platform.ledger.boundary_phase`). Where
communication is hidden, the bars sit on the communication threads' lanes while the training lane stays compute;
where it is not, every bar is matched by a wait.

The data is the ``timeline`` a worker records for step ``timeline_step`` (see `ds_asynchzp.bench.worker`): times
in seconds relative to the step's start. Arms without one (older results.json files) are skipped with a note.
"""

from __future__ import annotations

from pathlib import Path

from ..measure.boundary import union_seconds
from ..platform.ledger import BOUNDARY_PHASES

TRAINING_THREAD = "MainThread"
# Lanes in this order; threads of other names (none issue collectives today) follow, sorted.
COMM_THREADS = ("asynchzp-gather", "asynchzp-reduce", "asynchzp-boundary")
TRAINING_LANE = "training thread"
LANE_NAMES = {TRAINING_THREAD: "training thread collectives"}
COMPUTE_COLOR = "#d0d0d0"
WAIT_COLOR = "tab:red"
# Tag colours: tab10 and the light tab20 shades, without the reds and greys the training lane uses.
TAG_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan",
              "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5")
INTER_NODE_HATCH = "////"
# Under optimizer offload, one lane per phase of the step boundary (busy intervals, any thread).
PHASE_LANE = "boundary: "
PHASE_COLOR = "#4d4d4d"
BAR_HEIGHT = 0.7
LANE_INCHES = 0.42  # figure height per lane, so a subplot with more threads gets more room
TITLE_INCHES = 0.75
TITLE_CHARS = 115  # what fits on one line of a subplot title at the figure's width


def _figure(rows: int, height: float, height_ratios: list[float] | None = None):
    # A bare Figure on the Agg canvas, as the other plots of the report: no pyplot, no global state, no display.
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("the benchmark report needs matplotlib: pip install 'ds-asynchzp[bench]'") from exc
    fig = Figure(figsize=(12, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, 1, squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": height_ratios} if height_ratios else None)


def has_timeline(entry: dict) -> bool:
    timeline = entry.get("timeline")
    return isinstance(timeline, dict) and timeline.get("duration_s") is not None


def thread_lanes(timeline: dict) -> list[str]:
    """Threads that issued a collective in the step: the training thread, the communication threads, others."""
    threads = {c["thread"] for c in timeline.get("collectives") or []}
    known = [t for t in (TRAINING_THREAD, *COMM_THREADS) if t in threads]
    return known + sorted(threads - set(known))


def phase_lanes(timeline: dict) -> list[str]:
    """The offload boundary's phases that ran in the step (`platform.ledger.BOUNDARY_PHASES`), one lane each."""
    kinds = {p["kind"] for p in timeline.get("boundary_phases") or []}
    return [kind for kind in BOUNDARY_PHASES if kind in kinds]


def tag_colors(timelines) -> dict:
    """One colour per tag over every arm, in sorted order, so a tag reads the same in every subplot."""
    tags = sorted({c["tag"] for t in timelines for c in t.get("collectives") or []})
    return {tag: TAG_COLORS[i % len(TAG_COLORS)] for i, tag in enumerate(tags)}


def _where(entry: dict) -> tuple:
    """(optimizer step counted from 1, rank): timeline_step counts from 0, the report from 1, as loss.png does.
    Rank 0 where results do not say (aggregation keeps rank 0's timeline)."""
    step = entry.get("timeline_step")
    return (None if step is None else step + 1), entry.get("timeline_rank", 0)


def _where_text(step, rank) -> str:
    return f"optimizer step {'?' if step is None else step}, rank {rank}"


def _draw_arm(ax, arm: str, entry: dict, colors: dict, say_where: bool) -> None:
    timeline = entry["timeline"]
    duration = timeline["duration_s"]
    collectives = timeline.get("collectives") or []
    waits = [(w["start"], w["end"]) for w in timeline.get("waits") or [] if w["end"] > w["start"]]
    phases = phase_lanes(timeline)
    lanes = [TRAINING_LANE, *thread_lanes(timeline), *(PHASE_LANE + kind for kind in phases)]
    ys = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}  # top to bottom in lane order
    half = BAR_HEIGHT / 2
    for kind in phases:
        bars = [(p["start"], max(p["end"] - p["start"], 0.0)) for p in timeline["boundary_phases"]
                if p["kind"] == kind]
        ax.broken_barh(bars, (ys[PHASE_LANE + kind] - half, BAR_HEIGHT), facecolor=PHASE_COLOR,
                       edgecolor=PHASE_COLOR, linewidth=0.5)

    y = ys[TRAINING_LANE]
    ax.broken_barh([(0.0, duration)], (y - half, BAR_HEIGHT), facecolor=COMPUTE_COLOR)
    if waits:
        # Edges in the fill colour keep waits of a few microseconds visible as lines.
        ax.broken_barh([(s, e - s) for s, e in waits], (y - half, BAR_HEIGHT), facecolor=WAIT_COLOR,
                       edgecolor=WAIT_COLOR, linewidth=0.5)
    for thread in lanes[1:len(lanes) - len(phases)]:
        y = ys[thread]
        mine = [c for c in collectives if c["thread"] == thread]
        for tag in sorted({c["tag"] for c in mine}):
            for inter in (False, True):
                bars = [(c["start"], max(c["end"] - c["start"], 0.0)) for c in mine
                        if c["tag"] == tag and bool(c.get("inter_node")) == inter]
                if bars:
                    ax.broken_barh(bars, (y - half, BAR_HEIGHT), facecolor=colors[tag],
                                   edgecolor="black" if inter else colors[tag], linewidth=0.5,
                                   hatch=INTER_NODE_HATCH if inter else None, alpha=0.9)
    ax.set_yticks([ys[lane] for lane in lanes], [LANE_NAMES.get(lane, lane) for lane in lanes])
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    # The step's own totals, computed from the drawn intervals, so the picture and its numbers agree.
    waited = union_seconds(waits)
    busy = union_seconds((c["start"], c["end"]) for c in collectives)
    where = f" ({_where_text(*_where(entry))})" if say_where else ""
    figures = (f"step {duration:.3f} s; training thread waited {waited:.3f} s; collectives in flight {busy:.3f} s; "
               f"{len(collectives)} collectives")
    # Long arm specs would push the figures past the subplot's edge: they then go on a line of their own.
    title = f"{arm}{where}: {figures}"
    ax.set_title(title if len(title) <= TITLE_CHARS else f"{arm}{where}:\n{figures}", loc="left", fontsize="medium")
    ax.grid(axis="x", alpha=0.3)


def _legend_handles(colors: dict, any_inter: bool) -> list:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=COMPUTE_COLOR, label="training thread: compute"),
               Patch(facecolor=WAIT_COLOR, label="waiting on communication")]
    handles += [Patch(facecolor=color, label=tag) for tag, color in colors.items()]
    if any_inter:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch=INTER_NODE_HATCH,
                             label="inter-node collective (hatched)"))
    return handles


def plot_timelines(arms: dict, path: Path) -> list[str]:
    """Write ``path`` for every arm that recorded a timeline; returns notes on the arms left out.

    With no timeline at all the file still holds a figure saying so, so the report's image link never shows a
    stale plot of an earlier run in the same directory."""
    drawn = {arm: entry for arm, entry in arms.items() if has_timeline(entry)}
    notes = [f"`{arm}`: no timeline recorded (results written before timelines were, or a worker that recorded "
             "none)" for arm in arms if arm not in drawn]
    if not drawn:
        fig, axes = _figure(1, 2.0)
        ax = axes[0, 0]
        ax.text(0.5, 0.5, "No arm of this run recorded a timeline", ha="center", va="center", fontsize="large",
                transform=ax.transAxes)
        ax.set_axis_off()
        fig.savefig(path, dpi=110)
        return notes

    timelines = [e["timeline"] for e in drawn.values()]
    colors = tag_colors(timelines)
    lanes = [1 + len(thread_lanes(t)) + len(phase_lanes(t)) for t in timelines]
    fig, axes = _figure(len(drawn), sum(LANE_INCHES * n + TITLE_INCHES for n in lanes) + 1.6,
                        [n + TITLE_INCHES / LANE_INCHES for n in lanes])
    places = {_where(e) for e in drawn.values()}
    for ax, (arm, entry) in zip(axes[:, 0], drawn.items()):
        _draw_arm(ax, arm, entry, colors, say_where=len(places) > 1)
    longest = max(t["duration_s"] for t in timelines)
    axes[0, 0].set_xlim(0, longest * 1.01 or 1.0)
    axes[-1, 0].set_xlabel("seconds since the start of the optimizer step")
    where = _where_text(*next(iter(places))) if len(places) == 1 else "step and rank per arm in its title"
    fig.suptitle(f"One optimizer step, interval by interval ({where}): training thread and collectives by "
                 "issuing thread")
    any_inter = any(c.get("inter_node") for t in timelines for c in t.get("collectives") or [])
    handles = _legend_handles(colors, any_inter)
    fig.legend(handles=handles, loc="outside lower center", ncols=min(4, len(handles)), fontsize="small")
    fig.savefig(path, dpi=110)
    return notes
