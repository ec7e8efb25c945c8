"""Pipeline Gantt chart and memory-over-time plots (PNG, PDF or SVG).

Both stay readable at any micro-batch count: past `FULL_GANTT_MAX_MICROBATCHES` the Gantt chart draws a
window of the iteration (warm-up, a few steady-state steps, cool-down) on one time scale, and the memory
plot draws each stage in its own panel, as a min-max envelope when the events outnumber the pixels. Each
drawing function returns what it drew, so tests can check the picture without looking at pixels.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lynx.plan import Plan
from lynx.simulate import Segment, SegmentKind, SimResult

K = SegmentKind
_COLORS = {K.F: "#4C72B0", K.B: "#55A868", K.RECOMPUTE: "#C44E52", K.OVERLAP: "#DD8452", K.STALL: "#E3E3E3",
           K.COPY_OUT: "#8172B3", K.RELOAD: "#937860"}
_LABELS = {K.F: "forward", K.B: "backward", K.RECOMPUTE: "recompute on the critical path",
           K.OVERLAP: "recompute hidden (in a collective window or a stall)", K.STALL: "stall",
           K.COPY_OUT: "offload copy to host (D2H stream)", K.RELOAD: "reload from host (H2D stream)"}
_COPY_LANE = {K.COPY_OUT: (0.37, 0.07), K.RELOAD: (0.29, 0.07)}
"""Copies run on their own streams: thin lanes above the compute bar (offset from the row, height)."""
_DPI = 130

FULL_GANTT_MAX_MICROBATCHES = 16
"""Up to this many micro-batches (x model chunks) per stage the whole iteration is drawn; beyond it a bar
would be a pixel or two wide at any sensible figure width, so a window of the iteration is drawn."""
STEADY_STEPS = 3
"""Steady-state steps (one forward + one backward on the first stage) in the middle window."""
_LABEL_FONT = 6.0


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass(frozen=True, slots=True)
class GanttDrawing:
    """What `gantt_figure` drew."""

    windows: tuple[tuple[float, float], ...]
    """The time ranges drawn, one panel each (one range: the whole pipeline)."""
    bars: int
    """Rectangles drawn, all kinds."""
    recompute_bars: int
    """Rectangles of recomputation (on the critical path or hidden)."""
    labels: int
    """Micro-batch numbers written inside bars (only where they fit)."""
    title: str
    cp_windows: int = 0
    """Context-parallel exchange windows drawn (`_draw_cp_windows`; 0 without CP)."""
    copy_bars: int = 0
    """Rectangles of offload copies (copy-out and reload lanes)."""


@dataclass(frozen=True, slots=True)
class MemoryDrawing:
    """What `memory_figure` drew."""

    panels: int
    envelope: bool
    """True when each panel shows a min-max envelope per time bin rather than every event."""
    budget_lines: int
    title: str


# --- Gantt -------------------------------------------------------------------------------------------------


def _compute_segments(sim: SimResult, stage: int) -> list[Segment]:
    segs = [s for s in sim.segments if s.stage == stage and s.kind in (K.F, K.B)]
    return sorted(segs, key=lambda s: s.start)


def gantt_windows(sim: SimResult) -> tuple[tuple[tuple[float, float], ...], str]:
    """The time ranges to draw and a phrase for the title saying what they are.

    The whole pipeline when it is short; otherwise warm-up (until the first stage has run two backwards,
    by which time every stage is in steady state), `STEADY_STEPS` steps from the middle of the first stage's
    steady state, and cool-down (from the first stage's second-to-last forward). Windows are found from the
    timeline, not from the schedule's formula, so they hold for 1F1B, interleaved and custom schedules."""
    end = sim.pipeline_time_s
    first = _compute_segments(sim, 0)
    per_stage = sum(1 for s in first if s.kind is K.F)
    if per_stage <= FULL_GANTT_MAX_MICROBATCHES:
        return ((0.0, end),), "whole iteration"
    bwd = [s for s in first if s.kind is K.B]
    fwd = [s for s in first if s.kind is K.F]
    t_warm = bwd[1].end
    t_cool = fwd[-2].start
    mid = (t_warm + t_cool) / 2
    i = next((k for k, s in enumerate(first) if s.start >= mid and s.kind is K.F), len(first))
    steady = first[i:i + 2 * STEADY_STEPS]
    if not steady or not t_warm < steady[0].start < steady[-1].end < t_cool:
        return ((0.0, end),), "whole iteration"  # a schedule too irregular for three disjoint windows
    s0, s1 = steady[0].start, steady[-1].end
    mbs = sorted({s.microbatch for s in steady if s.kind is K.F})
    n_mb = len({s.microbatch for s in fwd})
    phrase = (f"warm-up | {len(mbs)} steady-state steps (forwards of micro-batches {mbs[0]}-{mbs[-1]} "
              f"of {n_mb} on stage 0) | cool-down; {end - (t_warm + s1 - s0 + end - t_cool):.2f} s of "
              f"steady state not drawn, one time scale")
    return ((0.0, t_warm), (s0, s1), (t_cool, end)), phrase


def _row_y(p: int, stage: int) -> float:
    """Stage 0 at the top."""
    return float(p - 1 - stage)


def _clip(segs: Iterable[Segment], lo: float, hi: float) -> list[tuple[Segment, float, float]]:
    return [(s, max(s.start, lo), min(s.end, hi)) for s in segs if s.end > lo and s.start < hi]


def _draw_panel(ax: Any, sim: SimResult, lo: float, hi: float) -> tuple[int, int, int]:
    """Bars of one time window; returns (bars, recomputation bars). Hidden recomputation gets its own lane
    under each stage's row: it runs beside the compute it hides behind, so drawn in the row it would be
    covered. Recomputation bars have an edge in their own colour so a 2 ms one stays at least a pixel wide
    (a hatch would need a contrasting edge, which would eat such a bar, so colour and lane tell them apart)."""
    p = len(sim.stages)
    bars = recompute = copies = 0
    for stage in range(p):
        y = _row_y(p, stage)
        for kind in K:
            spans = [(a, b - a) for s, a, b in _clip((s for s in sim.segments if s.stage == stage and
                                                      s.kind is kind), lo, hi)]
            if not spans:
                continue
            ybox = (y - 0.45, 0.16) if kind is K.OVERLAP else \
                (y + _COPY_LANE[kind][0], _COPY_LANE[kind][1]) if kind in _COPY_LANE else (y - 0.25, 0.6)
            edge = "white" if kind in (K.F, K.B) else _COLORS[kind]
            ax.broken_barh(spans, ybox, facecolors=_COLORS[kind], edgecolors=edge, linewidth=0.4)
            bars += len(spans)
            recompute += len(spans) if kind in (K.RECOMPUTE, K.OVERLAP) else 0
            copies += len(spans) if kind in _COPY_LANE else 0
    ax.set_xlim(lo, hi)
    ax.set_ylim(-0.6, p - 0.4)
    return bars, recompute, copies


def _label_bars(fig: Any, axes: Sequence[Any], sim: SimResult, windows: Sequence[tuple[float, float]]) -> int:
    """Micro-batch numbers inside forward/backward bars, only where the text fits the bar: the layout is
    drawn first so the bar widths in pixels are known."""
    fig.canvas.draw()
    chunked = any(s.chunk for s in sim.segments)
    char_px = 0.62 * _LABEL_FONT * fig.dpi / 72
    p = len(sim.stages)
    n = 0
    for ax, (lo, hi) in zip(axes, windows, strict=True):
        px_per_s = ax.get_window_extent().width / (hi - lo)
        for s, a, b in _clip((s for s in sim.segments if s.kind in (K.F, K.B)), lo, hi):
            text = f"{s.microbatch}.{s.chunk}" if chunked else str(s.microbatch)
            if (b - a) * px_per_s < len(text) * char_px + 4:
                continue
            ax.text((a + b) / 2, _row_y(p, s.stage) + 0.05, text, ha="center", va="center",
                    fontsize=_LABEL_FONT, color="white", clip_on=True)
            n += 1
    return n


def _mark_breaks(axes: Sequence[Any]) -> None:
    """Diagonal cuts between windows, the usual sign of an elided axis."""
    kw: dict[str, Any] = {"marker": [(-1, -1.5), (1, 1.5)], "markersize": 9, "linestyle": "none",
                          "color": "k", "mec": "k", "mew": 1, "clip_on": False}
    for left, right in zip(axes, axes[1:], strict=False):
        left.spines["right"].set_visible(False)
        right.spines["left"].set_visible(False)
        left.plot([1, 1], [0, 1], transform=left.transAxes, **kw)
        right.plot([0, 0], [0, 1], transform=right.transAxes, **kw)
        right.tick_params(axis="y", left=False)


def _gantt_title(plan: Plan, phrase: str) -> str:
    sim, r = plan.sim, plan.result
    crit = sum(s.recompute_critical_s for s in sim.stages)
    hidden = sum(s.recompute_overlapped_s for s in sim.stages)
    return (f"{plan.problem.model.name} {r.method} partition {r.partition}: iteration "
            f"{sim.iteration_time_s:.3f} s, bubble {sim.bubble_fraction:.1%}; recomputation summed over "
            f"stages: {crit:.3f} s on the critical path, {hidden:.3f} s hidden\n{phrase}")


def gantt_figure(plan: Plan) -> tuple[Any, GanttDrawing]:
    """The Gantt chart as an open matplotlib figure (the caller saves and closes it)."""
    plt = _plt()
    sim = plan.sim
    p = len(sim.stages)
    windows, phrase = gantt_windows(sim)
    spans = [hi - lo for lo, hi in windows]
    # One time scale across panels: each panel's width is proportional to the time it shows.
    fig, axes = plt.subplots(1, len(windows), figsize=(14, 0.75 * p + 2.4), sharey=True, squeeze=False,
                             width_ratios=spans, layout="constrained")
    axes = list(axes[0])
    bars = recompute = copies = 0
    for ax, (lo, hi) in zip(axes, windows, strict=True):
        b, r, c = _draw_panel(ax, sim, lo, hi)
        bars, recompute, copies = bars + b, recompute + r, copies + c
        ax.tick_params(axis="x", labelsize=8)
    axes[0].set_yticks([_row_y(p, s) for s in range(p)], [f"stage {s}" for s in range(p)])
    _mark_breaks(axes)
    # On the middle panel, not the figure: a figure-level label would share the bottom with the legend.
    axes[len(axes) // 2].set_xlabel("time (s)", fontsize=9)
    if any(s.chunk for s in sim.segments):
        phrase += "; bar labels: micro-batch.model chunk"
    title = _gantt_title(plan, phrase)
    fig.suptitle(title, fontsize=9)
    cp = sum(_draw_cp_windows(ax, plan, lo, hi) for ax, (lo, hi) in zip(axes, windows, strict=True))
    kinds = [k for k in _COLORS if k not in _COPY_LANE or any(s.kind is k for s in sim.segments)]
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=_COLORS[k], edgecolor=_COLORS[k]) for k in kinds]
    names = [_LABELS[k] for k in kinds]
    if cp:
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor=_CP_COLOR, edgecolor=_CP_COLOR))
        names.append(_CP_LABEL)
    fig.legend(handles, names, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    labels = _label_bars(fig, axes, sim, windows)
    return fig, GanttDrawing(tuple(windows), bars, recompute, labels, title, cp, copies)


# --- context parallelism's exchange window (issue 21) ------------------------------------------------------

_CP_COLOR = "#DA8BC3"
_CP_LABEL = "CP exchange window (idle, recomputation can hide)"


def cp_window_spans(plan: Plan, lo: float, hi: float) -> dict[int, list[tuple[float, float]]]:
    """Per stage, the (start, width) of every layer's CP exchange window inside the forward and backward bars
    between `lo` and `hi`. Widths are the exposed exchange the cost model prices per layer (`report.windows.
    cp_exposure`, the CP share of Lynx's windows 1 and 4); the simulator charges a micro-batch's layers as one
    bar, so each layer's window is placed at its layer's share of the bar and at the exchange's place in the
    layer's op order (`cp_offset`): the positions are drawn to scale, not simulated op by op."""
    from lynx.report.windows import cp_exposure, cp_offset

    graph, part = plan.problem.graph, plan.result.partition
    if graph.meta.cp <= 1:
        return {}
    fwd, bwd = cp_exposure(graph, plan.problem.options.subtract_wgrad)
    at = {False: cp_offset(graph, False), True: cp_offset(graph, True)}
    lt = {False: graph.fwd_time(), True: graph.bwd_time()}
    out: dict[int, list[tuple[float, float]]] = {}
    for s, a, b in _clip((s for s in plan.sim.segments if s.kind in (K.F, K.B)), lo, hi):
        back = s.kind is K.B
        width = bwd if back else fwd
        layers = part.chunk_layers(s.stage)[s.chunk] if s.chunk < part.num_chunks else 0
        if width <= 0 or layers <= 0:
            continue
        step = (s.end - s.start) / layers
        scale = min(1.0, step / max(lt[back], 1e-30))  # a bar shorter than its layers' priced time: shrink
        for k in range(layers):
            x = s.start + k * step + at[back] * step
            if a <= x < b:
                out.setdefault(s.stage, []).append((x, min(width * scale, b - x)))
    return out


def _draw_cp_windows(ax: Any, plan: Plan, lo: float, hi: float) -> int:
    """A thin lane above each stage's row with its CP exchange windows (`cp_window_spans`); returns the
    number drawn."""
    p = len(plan.sim.stages)
    n = 0
    for stage, spans in cp_window_spans(plan, lo, hi).items():
        y = _row_y(p, stage)
        ax.broken_barh(spans, (y + 0.45, 0.07), facecolors=_CP_COLOR, edgecolors=_CP_COLOR, linewidth=0.4)
        n += len(spans)
    return n


def gantt(plan: Plan, path: str | Path) -> GanttDrawing:
    """One row per stage: forward, backward, recomputation on the critical path, stalls, and hidden
    recomputation in a lane under each row."""
    fig, drawing = gantt_figure(plan)
    fig.savefig(path, dpi=_DPI)
    _plt().close(fig)
    return drawing


# --- memory over time --------------------------------------------------------------------------------------

ENVELOPE_BINS = 400
"""Above this many events per stage the curve is drawn as a min-max envelope in this many time bins: the
step curve would fill the panel solid anyway, and the envelope says what it hides."""


def envelope(curve: Sequence[tuple[float, float]], t_end: float, bins: int) -> tuple[list[float], list[float],
                                                                                       list[float]]:
    """Bin edges' left times, and the least and greatest value of the step curve within each bin (a value
    holds from its event to the next)."""
    width = t_end / bins if t_end > 0 else 1.0
    lo = [float("inf")] * bins
    hi = [float("-inf")] * bins
    for k, (t, v) in enumerate(curve):
        t_next = curve[k + 1][0] if k + 1 < len(curve) else t_end
        first = min(bins - 1, max(0, int(t / width)))
        last = min(bins - 1, max(first, int(t_next / width - 1e-12)))
        for b in range(first, last + 1):
            lo[b] = min(lo[b], v)
            hi[b] = max(hi[b], v)
    # A bin no event reaches (only before the first one) takes its neighbour's value.
    for b in range(bins):
        if lo[b] == float("inf"):
            lo[b] = hi[b] = curve[0][1] if curve else 0.0
    return [b * width for b in range(bins)], lo, hi


def _memory_panel(ax: Any, sim: SimResult, stage: int, use_envelope: bool, color: str) -> None:
    curve = sim.memory_curves[stage]
    budget = sim.stages[stage].budget_bytes / 2**30
    t_end = max(sim.pipeline_time_s, curve[-1][0] if curve else 0.0)
    if use_envelope:
        xs, lo, hi = envelope(curve, t_end, ENVELOPE_BINS)
        xs.append(t_end)
        lo_g, hi_g = [v / 2**30 for v in lo + lo[-1:]], [v / 2**30 for v in hi + hi[-1:]]
        ax.fill_between(xs, lo_g, hi_g, step="post", color=color, alpha=0.35, lw=0)
        ax.step(xs, hi_g, where="post", color=color, lw=0.8)
    else:
        ax.step([t for t, _ in curve], [b / 2**30 for _, b in curve], where="post", color=color, lw=1.0)
    ys = [b / 2**30 for _, b in curve] or [0.0]
    peak = max(ys)
    t_peak = curve[ys.index(peak)][0] if curve else 0.0
    over = peak > budget * (1 + 1e-9)
    ax.axhline(budget, color="#C44E52", ls="--", lw=1.0)
    ax.plot([t_peak], [peak], "o", color="#C44E52" if over else "black", ms=3)
    ax.text(0.995, 0.96, f"peak {peak:.1f} GiB / budget {budget:.1f} GiB" + ("  OVER BUDGET" if over else ""),
            transform=ax.transAxes, ha="right", va="top", fontsize=7, color="#C44E52" if over else "black")
    # Headroom above the larger of peak and budget keeps the budget line and the text clear of the frame.
    ax.set_ylim(0, max(peak, budget) * 1.25)
    ax.set_xlim(0, t_end)
    ax.set_ylabel(f"stage {stage}\nGiB", fontsize=8)
    ax.tick_params(labelsize=7)


def memory_figure(plan: Plan) -> tuple[Any, MemoryDrawing]:
    """One panel per stage (stage 0 at the top, like the Gantt chart), sharing the time axis, each with its
    budget as a dashed line and its peak marked."""
    plt = _plt()
    sim = plan.sim
    p = len(sim.stages)
    use_envelope = max((len(c) for c in sim.memory_curves), default=0) > ENVELOPE_BINS
    fig, axes = plt.subplots(p, 1, figsize=(11, 1.25 * p + 1.6), sharex=True, squeeze=False,
                             layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for s in range(p):
        _memory_panel(axes[s][0], sim, s, use_envelope, colors[s % len(colors)])
    axes[-1][0].set_xlabel("time (s)", fontsize=8)
    how = (f"shaded: least to greatest within each {sim.pipeline_time_s / ENVELOPE_BINS * 1e3:.0f} ms "
           f"(too many events to draw each); line: greatest" if use_envelope else "every allocation and free")
    title = f"{plan.problem.model.name} {plan.result.method}: memory per stage over one iteration\n{how}"
    fig.suptitle(title, fontsize=9)
    handles = [plt.Line2D([], [], color="#555555", lw=1.0), plt.Line2D([], [], color="#C44E52", ls="--"),
               plt.Line2D([], [], color="black", marker="o", ls="none", ms=3)]
    fig.legend(handles, ["memory in use", "budget", "peak"], loc="outside lower center", ncol=3, fontsize=8,
               frameon=False)
    return fig, MemoryDrawing(p, use_envelope, p, title)


def memory_plot(plan: Plan, path: str | Path) -> MemoryDrawing:
    """Memory over time per stage, with each stage's budget."""
    fig, drawing = memory_figure(plan)
    fig.savefig(path, dpi=_DPI)
    _plt().close(fig)
    return drawing
