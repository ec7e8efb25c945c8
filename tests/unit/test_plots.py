"""The plots stay readable: bounded bars at 256 micro-batches, recomputation drawn when the plan recomputes,
over-budget bars marked, and every title and label inside the figure (checked with matplotlib's renderer
extents, not by eye). Plans use fast methods so each test takes a fraction of a second."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lynx.api import plan as plan_one
from lynx.breakdown import stage_memories
from lynx.cli.common import build_request
from lynx.cli.plan import with_vpp
from lynx.plan import Plan
from lynx.report.memory import OVER_COLOR, memory_bars, memory_bars_figure
from lynx.report.plots import (
    FULL_GANTT_MAX_MICROBATCHES,
    envelope,
    gantt,
    gantt_figure,
    gantt_windows,
    memory_figure,
    memory_plot,
)
from lynx.simulate import SegmentKind

pytest.importorskip("matplotlib")


def _plan(mb: int, gb: int, method: str, vpp: int = 1) -> Plan:
    problem = build_request("gpt-7b", "a100-40g-nvlink", 4, 4, 1, False, mb, gb, 1024).problem()
    return plan_one(with_vpp(problem, vpp) if vpp > 1 else problem, method)


@pytest.fixture(scope="module")
def many() -> Plan:
    """256 micro-batches, recomputed on demand (full recomputation)."""
    return _plan(1, 256, "full")


@pytest.fixture(scope="module")
def readme() -> Plan:
    """The README's layout at micro-batch 16: Lynx-HEU recomputes some on demand and hides some."""
    return _plan(16, 128, "lynx-heu")


def _inside(inner: Any, outer: Any, slack: float = 0.5) -> bool:
    return (inner.x0 >= outer.x0 - slack and inner.y0 >= outer.y0 - slack and inner.x1 <= outer.x1 + slack
            and inner.y1 <= outer.y1 + slack)


def _renderer(fig: Any) -> Any:
    """The renderer after a draw: the layout engine places the legend and titles only when drawing."""
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _close(fig: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_gantt_for_256_microbatches_draws_a_bounded_window(many: Plan, tmp_path: Path) -> None:
    drawing = gantt(many, tmp_path / "g.png")
    assert len(drawing.windows) == 3  # warm-up, steady state, cool-down
    assert drawing.bars < 400  # the whole iteration would be over 3,800 rectangles
    assert "256" in drawing.title and "not drawn" in drawing.title  # the title says it is a window
    assert drawing.labels > 20  # micro-batch numbers where they fit
    assert drawing.recompute_bars > 0  # full recomputation shows
    (lo0, hi0), (lo1, hi1), (lo2, hi2) = drawing.windows
    assert lo0 == 0.0 and hi0 < lo1 < hi1 < lo2 < hi2 == pytest.approx(many.sim.pipeline_time_s)
    assert (tmp_path / "g.png").stat().st_size > 10_000


def test_short_pipelines_are_drawn_whole(readme: Plan) -> None:
    windows, phrase = gantt_windows(readme.sim)
    assert windows == ((0.0, readme.sim.pipeline_time_s),) and phrase == "whole iteration"


def test_window_starts_past_the_threshold() -> None:
    just_over = _plan(1, FULL_GANTT_MAX_MICROBATCHES * 2, "none")
    assert len(gantt_windows(just_over.sim)[0]) == 3
    at = _plan(1, FULL_GANTT_MAX_MICROBATCHES, "none")
    assert len(gantt_windows(at.sim)[0]) == 1


def test_gantt_draws_both_kinds_of_recomputation(readme: Plan) -> None:
    kinds = {s.kind for s in readme.sim.segments}
    assert {SegmentKind.RECOMPUTE, SegmentKind.OVERLAP} <= kinds
    fig, drawing = gantt_figure(readme)
    try:
        expected = sum(1 for s in readme.sim.segments if s.kind in (SegmentKind.RECOMPUTE, SegmentKind.OVERLAP))
        assert drawing.recompute_bars == expected
        legend = fig.legends[0]
        texts = [t.get_text() for t in legend.get_texts()]
        assert any("critical path" in t for t in texts) and any("hidden" in t for t in texts)
        # Every micro-batch's forward and backward fits its label at 8 micro-batches.
        assert drawing.labels == sum(1 for s in readme.sim.segments if s.kind in (SegmentKind.F, SegmentKind.B))
    finally:
        _close(fig)


def test_no_recomputation_no_recompute_bars() -> None:
    fig, drawing = gantt_figure(_plan(4, 32, "none"))
    _close(fig)
    assert drawing.recompute_bars == 0


def test_gantt_legend_and_title_inside_the_figure_and_off_the_axes(many: Plan) -> None:
    fig, _ = gantt_figure(many)
    try:
        renderer = _renderer(fig)
        fig_box = fig.bbox
        legend_box = fig.legends[0].get_window_extent(renderer)
        title_box = fig._suptitle.get_window_extent(renderer)
        assert _inside(legend_box, fig_box) and _inside(title_box, fig_box)
        for ax in fig.axes:
            ax_box = ax.get_window_extent(renderer)
            assert not legend_box.overlaps(ax_box)  # the legend covers no data
            assert not title_box.overlaps(ax_box)
            xlabel = ax.xaxis.label
            if xlabel.get_text():
                assert not xlabel.get_window_extent(renderer).overlaps(legend_box)
    finally:
        _close(fig)


def test_interleaved_labels_name_the_chunk() -> None:
    fig, drawing = gantt_figure(_plan(16, 128, "full", vpp=2))
    try:
        labels = [t.get_text() for ax in fig.axes for t in ax.texts]
        assert drawing.labels == len(labels) > 0 and all("." in t for t in labels)
    finally:
        _close(fig)


def test_memory_plot_one_panel_per_stage_with_budget(readme: Plan, tmp_path: Path) -> None:
    drawing = memory_plot(readme, tmp_path / "m.png")
    assert drawing.panels == 4 and drawing.budget_lines == 4 and not drawing.envelope
    fig, _ = memory_figure(readme)
    try:
        renderer = _renderer(fig)
        boxes = [ax.get_window_extent(renderer) for ax in fig.axes]
        assert all(not a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])  # no overlapping bands
        legend_box = fig.legends[0].get_window_extent(renderer)
        assert all(not legend_box.overlaps(b) for b in boxes) and _inside(legend_box, fig.bbox)
        for s, ax in enumerate(fig.axes):
            budget = readme.sim.stages[s].budget_bytes / 2**30
            assert ax.get_ylim()[1] > budget  # the budget line is in view
            assert any(line.get_ydata()[0] == pytest.approx(budget) for line in ax.get_lines())
    finally:
        _close(fig)


def test_memory_plot_of_many_microbatches_is_an_envelope(many: Plan) -> None:
    fig, drawing = memory_figure(many)
    _close(fig)
    assert drawing.envelope and "within each" in drawing.title


def test_envelope_holds_each_value_until_the_next_event() -> None:
    # 0 on [0, 1), 10 on [1, 1.5), 2 on [1.5, 4): four bins of 1 s.
    xs, lo, hi = envelope([(0.0, 0.0), (1.0, 10.0), (1.5, 2.0)], 4.0, 4)
    assert xs == [0.0, 1.0, 2.0, 3.0]
    assert lo == [0.0, 2.0, 2.0, 2.0] and hi == [0.0, 10.0, 2.0, 2.0]


def test_memory_bars_mark_over_budget_and_keep_labels_inside(tmp_path: Path) -> None:
    stages = stage_memories(_plan(16, 128, "none"))
    over = tuple(i for i, st in enumerate(stages) if st.peak > st.budget_bytes)
    assert over  # keeping everything at micro-batch 16 does not fit
    title = ("gpt-7b on a100-40g-nvlink: TP 4 PP 4 DP 1, micro-batch 16, none, partition 7,9,9,7; "
             "megatron-bf16 12 B/param (distributed optimizer) and some more words to make it long")
    fig, drawing = memory_bars_figure(stages, title)
    try:
        assert drawing.over_budget == over
        ax = fig.axes[0]
        outlined = [p for p in ax.patches if p.get_facecolor()[3] == 0 and p.get_linewidth() > 2]
        from matplotlib.colors import to_rgba

        assert len(outlined) == len(over) and all(p.get_edgecolor() == to_rgba(OVER_COLOR) for p in outlined)
        assert "over budget" in " ".join(t.get_text() for t in ax.get_legend().get_texts())
        renderer = _renderer(fig)
        ax_box = ax.get_window_extent(renderer)
        assert _inside(drawing.title.get_window_extent(renderer), fig.bbox)
        for label in drawing.value_labels:
            assert _inside(label.get_window_extent(renderer), ax_box)  # clear of the frame
        assert _inside(ax.get_legend().get_window_extent(renderer), fig.bbox)
        assert not ax.get_legend().get_window_extent(renderer).overlaps(ax_box)
    finally:
        _close(fig)
    memory_bars(stages, tmp_path / "bars.png", title)
    assert (tmp_path / "bars.png").stat().st_size > 10_000


def test_memory_bars_within_budget_have_no_over_budget_marks() -> None:
    stages = stage_memories(_plan(4, 128, "none"))
    assert all(st.peak <= st.budget_bytes for st in stages)
    fig, drawing = memory_bars_figure(stages, "fits")
    try:
        assert drawing.over_budget == ()
        assert "over budget" not in " ".join(t.get_text() for t in fig.axes[0].get_legend().get_texts())
    finally:
        _close(fig)
