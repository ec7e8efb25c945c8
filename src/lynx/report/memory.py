"""`lynx memory`: the per-stage memory breakdown as a rich table and a stacked-bar PNG."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from lynx.breakdown import StageMemory

GiB = float(1 << 30)
_COLORS = ("#4C72B0", "#8172B3", "#64B5CD", "#55A868", "#DD8452", "#CCB974", "#937860")
"""One per term; none is red, which marks bars over budget."""
OVER_COLOR = "#D62728"
"""Bars over their budget (outline, hatch, value and tick label)."""


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _g(x: float) -> str:
    return f"{x / GiB:.2f}"


def _in_flight(st: StageMemory) -> str:
    """Micro-batches held; an interleaved stage shows its chunk micro-batches at the peak ("71c")."""
    return f"{st.act.chunk_microbatches}c" if st.act.chunk_microbatches else str(st.act.in_flight)


def memory_table(stages: Sequence[StageMemory], title: str) -> Table:
    t = Table(title=title, title_justify="left", caption_justify="left",
              caption="GiB per device. activations = per micro-batch x in flight (interleaved stages, Nc: the N chunk "
                      "micro-batches alive at the schedule's peak, summed over chunks); forward windows: recomputed in "
                      "forward collectives and held (M_fwd_comm); transient: largest working set + gradient "
                      "buffers; peak: the closed form the planner constrains (sim: the event simulator's); with "
                      "offloading, offloaded/mb: the part of act/mb copied to host memory (on the device for one "
                      "micro-batch), host: the pinned host memory it takes")
    cols: tuple[str, ...] = ("stage", "layers", "params", "grads", "optimizer", "act/mb", "in flight",
                             "activations", "fwd windows", "transient", "emb/logits", "peak", "sim peak", "budget",
                             "headroom")
    offloads = any(st.act.offloaded_per_microbatch > 0 for st in stages)
    if offloads:  # where the offloaded bytes went (docs/offload.md); absent for plans that do not offload
        cols = (*cols[:6], "offloaded/mb", "host", *cols[6:])
    for c in cols:
        t.add_column(c, justify="right")
    step = max((st.static.step_bytes for st in stages), default=0.0)
    if step > 0:  # the fp16 recipe: Megatron's formula counts it in the state, the allocator sees it in the step
        t.caption = (f"{t.caption}. optimizer: without the fp32 main-gradient copy (up to {_g(step)} GiB) that only "
                     "the optimizer step holds, when no activation is alive; peak is at least static + that copy")
    for st in stages:
        head = st.headroom
        off = (_g(st.act.offloaded_per_microbatch), _g(st.act.host)) if offloads else ()
        t.add_row(
            str(st.stage), str(st.num_layers), _g(st.static.param_bytes), _g(st.static.grad_bytes),
            _g(st.static.optimizer_bytes), _g(st.act.per_microbatch), *off, _in_flight(st),
            _g(st.activations),
            _g(st.act.fwd_window), _g(st.transient), _g(st.embedding_logits), _g(st.peak),
            "" if st.simulated_peak_bytes is None else _g(st.simulated_peak_bytes), _g(st.budget_bytes),
            f"[red]{_g(head)}[/red]" if head < 0 else f"[green]{_g(head)}[/green]",
        )
    return t


@dataclass(frozen=True, slots=True)
class BarsDrawing:
    """What `memory_bars_figure` drew."""

    over_budget: tuple[int, ...]
    """Stages whose peak is over their budget, drawn outlined and hatched in `OVER_COLOR`."""
    value_labels: tuple[Any, ...]
    """The peak labels above the bars (matplotlib Text), for checking they sit inside the axes."""
    title: Any
    """The title (matplotlib Text)."""


def _wrap_title(title: str, fig_width_in: float, fontsize: float) -> str:
    """Wrap to the figure's width: an average glyph is about 0.55 em wide; a little slack for the margins."""
    per_line = max(30, int(0.9 * fig_width_in * 72 / (0.55 * fontsize)))
    # Break at the title's own "; " first, so each clause stays whole where it can.
    return "\n".join(textwrap.fill(part, per_line, break_on_hyphens=False) for part in title.split("; "))


def _mark_over_budget(ax: Any, x: float, st: StageMemory, width: float) -> None:
    """The part of the bar above the budget hatched, and the whole bar outlined, in the over-budget colour:
    the stacked colours stay readable and the bar still stands out."""
    budget, peak = st.budget_bytes / GiB, st.peak / GiB
    ax.bar([x], [peak - budget], bottom=[budget], width=width, facecolor="none", edgecolor=OVER_COLOR,
           hatch="///", lw=0, label="_nolegend_")
    ax.bar([x], [peak], width=width, facecolor="none", edgecolor=OVER_COLOR, lw=2.2, label="_nolegend_")


def _value_label(ax: Any, x: float, st: StageMemory, top: float, n: int, over: bool) -> Any:
    """The peak, centred just above the bar (beside it, the label ran into the frame or the next bar); above
    the budget line instead when that line is just over the bar, so the two do not cross."""
    peak, budget = st.peak / GiB, st.budget_bytes / GiB
    y = budget if 0 < budget - peak < 0.06 * top else peak
    text = f"{peak:.1f}" + (f"\n+{-st.headroom / GiB:.1f} over" if over else "")
    return ax.annotate(text, (x, y), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                       fontsize=8 if n <= 16 else 6, color=OVER_COLOR if over else "black")


def memory_bars_figure(stages: Sequence[StageMemory], title: str) -> tuple[Any, BarsDrawing]:
    """The stacked bars as an open figure (the caller saves and closes it)."""
    plt = _plt()
    n = len(stages)
    # Wide enough for the tick labels, capped so 32 stages do not make a poster.
    fig_w = min(18.0, max(6.5, 1.1 * n + 4.0))
    fig, ax = plt.subplots(figsize=(fig_w, 5.0), layout="constrained")
    xs = list(range(n))
    width = 0.6
    bottoms = [0.0] * n
    names = list(stages[0].terms()) if stages else []
    for k, name in enumerate(names):
        vals = [st.terms()[name] / GiB for st in stages]
        ax.bar(xs, vals, bottom=bottoms, color=_COLORS[k % len(_COLORS)], label=name, width=width)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    over = tuple(i for i, st in enumerate(stages) if st.headroom < 0)
    labels = []
    top = max((max(st.peak, st.budget_bytes) for st in stages), default=GiB) / GiB
    for x, st in zip(xs, stages, strict=True):
        ax.hlines(st.budget_bytes / GiB, x - 0.42, x + 0.42, colors="black", linestyles=":", lw=1.4,
                  label="budget" if x == 0 else "_nolegend_")
        if x in over:
            _mark_over_budget(ax, x, st, width)
        labels.append(_value_label(ax, x, st, top, n, x in over))
    ax.set_ylim(0, top * 1.16)  # headroom for the labels above the tallest bar (two lines when over)
    ax.set_xticks(xs, [f"stage {st.stage}\n{st.num_layers} layers" for st in stages], fontsize=8)
    for i in over:
        ax.get_xticklabels()[i].set_color(OVER_COLOR)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel("GiB per device")
    title_text = ax.set_title(_wrap_title(title, fig_w, 9), fontsize=9, loc="left")
    handles, names = ax.get_legend_handles_labels()
    if over:
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="none", edgecolor=OVER_COLOR, hatch="///", lw=2.2))
        names.append("over budget (outlined,\nexcess hatched)")
    # Outside the axes, right: inside, it covered the bars.
    ax.legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig, BarsDrawing(over, tuple(labels), title_text)


def memory_bars(stages: Sequence[StageMemory], path: str | Path, title: str) -> BarsDrawing:
    """One stacked bar per stage (the terms of its peak), a dotted line at each stage's budget, bars over
    their budget outlined and hatched in red."""
    fig, drawing = memory_bars_figure(stages, title)
    fig.savefig(path, dpi=130)
    _plt().close(fig)
    return drawing
