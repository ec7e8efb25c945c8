"""Pipeline Gantt chart and memory-per-stage plots (PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lynx.plan import Plan
from lynx.simulate import SegmentKind

K = SegmentKind
_COLORS = {K.F: "#4C72B0", K.B: "#55A868", K.RECOMPUTE: "#C44E52", K.OVERLAP: "#DD8452", K.STALL: "#DDDDDD"}
_LABELS = {K.F: "forward", K.B: "backward", K.RECOMPUTE: "recompute (on demand)",
           K.OVERLAP: "recompute (overlapped)", K.STALL: "stall"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def gantt(plan: Plan, path: str | Path) -> None:
    """One row per stage: forward, backward, on-demand recomputation, stalls; overlapped recomputation is
    drawn as a thin bar under the compute it hides behind."""
    plt = _plt()
    sim = plan.sim
    p = len(sim.stages)
    fig, ax = plt.subplots(figsize=(14, 0.7 * p + 1.6))
    for seg in sim.segments:
        y = p - 1 - seg.stage
        if seg.kind is K.OVERLAP:
            ax.barh(y - 0.32, seg.end - seg.start, left=seg.start, height=0.16, color=_COLORS[K.OVERLAP])
        else:
            ax.barh(y, seg.end - seg.start, left=seg.start, height=0.6, color=_COLORS[seg.kind],
                    edgecolor="white" if seg.kind in (K.F, K.B) else None, linewidth=0.3)
            if seg.kind in (K.F, K.B) and (seg.end - seg.start) > sim.pipeline_time_s / 60:
                ax.text((seg.start + seg.end) / 2, y, str(seg.microbatch), ha="center", va="center",
                        fontsize=6, color="white")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {p - 1 - i}" for i in range(p)])
    ax.set_xlabel("time (s)")
    r = plan.result
    ax.set_title(f"{plan.problem.model.name} {r.method} partition {r.partition}: iteration "
                 f"{sim.iteration_time_s:.3f} s, bubble {sim.bubble_fraction:.1%}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, list(_LABELS.values()), loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=5,
              fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def memory_plot(plan: Plan, path: str | Path) -> None:
    """Memory over time per stage, with each stage's budget."""
    plt = _plt()
    sim = plan.sim
    fig, ax = plt.subplots(figsize=(10, 4))
    for s, curve in enumerate(sim.memory_curves):
        xs = [t for t, _ in curve]
        ys = [b / 2**30 for _, b in curve]
        line = ax.step(xs, ys, where="post", label=f"stage {s}")[0]
        ax.axhline(sim.stages[s].budget_bytes / 2**30, color=line.get_color(), ls=":", lw=0.8)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GiB")
    ax.set_title(f"{plan.problem.model.name} {plan.result.method}: memory per stage (dotted: budget)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
