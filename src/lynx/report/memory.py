"""`lynx memory`: the per-stage memory breakdown as a rich table and a stacked-bar PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from lynx.breakdown import StageMemory

GiB = float(1 << 30)
_COLORS = ("#4C72B0", "#8172B3", "#64B5CD", "#55A868", "#DD8452", "#C44E52", "#937860")


def _g(x: float) -> str:
    return f"{x / GiB:.2f}"


def memory_table(stages: Sequence[StageMemory], title: str) -> Table:
    t = Table(title=title, title_justify="left", caption_justify="left",
              caption="GiB per device. activations = per micro-batch x in flight; forward windows: recomputed in "
                      "forward collectives and held (M_fwd_comm); transient: largest working set + gradient "
                      "buffers; peak: the closed form the planner constrains (sim: the event simulator's)")
    cols = ("stage", "layers", "params", "grads", "optimizer", "act/mb", "in flight", "activations",
            "fwd windows", "transient", "emb/logits", "peak", "sim peak", "budget", "headroom")
    for c in cols:
        t.add_column(c, justify="right")
    for st in stages:
        head = st.headroom
        t.add_row(
            str(st.stage), str(st.num_layers), _g(st.static.param_bytes), _g(st.static.grad_bytes),
            _g(st.static.optimizer_bytes), _g(st.act.per_microbatch), str(st.act.in_flight), _g(st.activations),
            _g(st.act.fwd_window), _g(st.transient), _g(st.embedding_logits), _g(st.peak),
            "" if st.simulated_peak_bytes is None else _g(st.simulated_peak_bytes), _g(st.budget_bytes),
            f"[red]{_g(head)}[/red]" if head < 0 else f"[green]{_g(head)}[/green]",
        )
    return t


def memory_bars(stages: Sequence[StageMemory], path: str | Path, title: str) -> None:
    """One stacked bar per stage (the terms of its peak), a dotted line at each stage's budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(stages) + 3.0), 4.5))
    xs = list(range(len(stages)))
    bottoms = [0.0] * len(stages)
    names = list(stages[0].terms()) if stages else []
    for k, name in enumerate(names):
        vals = [st.terms()[name] / GiB for st in stages]
        ax.bar(xs, vals, bottom=bottoms, color=_COLORS[k % len(_COLORS)], label=name, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    for x, st in zip(xs, stages, strict=True):
        ax.hlines(st.budget_bytes / GiB, x - 0.4, x + 0.4, colors="black", linestyles=":", lw=1.2,
                  label="budget" if x == 0 else "_nolegend_")
        ax.text(x + 0.32, bottoms[x], f"{st.peak / GiB:.1f}", ha="left", va="center", fontsize=8)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"stage {st.stage}\n{st.num_layers} layers" for st in stages])
    ax.set_ylabel("GiB per device")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
