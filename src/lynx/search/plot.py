"""`lynx plan --gpus N --search-png`: every simulated candidate's iteration time against its fullest stage's peak
memory, with the budget, the Pareto front (no candidate both faster and smaller), and labelled points for the
winner, the fastest stock configuration (Megatron-Core's, or torchtitan's for its target) and each published
recipe."""

from __future__ import annotations

from pathlib import Path

from lynx.search.evaluate import Outcome
from lynx.search.run import SearchResult


def pareto_front(points: list[Outcome]) -> list[Outcome]:
    """The fitting candidates no other fitting one beats in both time and peak memory, by peak memory."""
    front: list[Outcome] = []
    for o in sorted(points, key=lambda o: (max(o.stage_peak_gib), o.iteration_s)):
        if not front or o.iteration_s < front[-1].iteration_s:
            front.append(o)
    return front


def _label(o: Outcome, who: str) -> str:
    c = o.candidate
    split = "" if not c.stock or c.split.even else f" [{c.split.label()}]"
    fits = "" if o.fits else " (does not fit)"
    return f"{who}: {c.layout.label()} {c.method}{split}, {o.iteration_s:.4g} s{fits}"


def scatter_png(res: SearchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sims = [o for o in res.outcomes if o.stage_peak_gib]
    fig, ax = plt.subplots(figsize=(9, 7))
    for fits, color, label in ((True, "tab:blue", "fits"), (False, "tab:gray", "does not fit")):
        pts = [o for o in sims if o.fits == fits]
        ax.scatter([max(o.stage_peak_gib) for o in pts], [o.iteration_s for o in pts], s=8, c=color,
                   alpha=0.5, label=label)
    front = pareto_front([o for o in sims if o.fits])
    if front:
        ax.step([max(o.stage_peak_gib) for o in front], [o.iteration_s for o in front], where="post",
                color="tab:purple", lw=1, label="Pareto front (time vs memory)")
    marks = [(res.best, "*", "tab:orange", "lynx's pick"),
             (res.best_stock, "s", "tab:green", f"stock {res.space.stock.value}")]
    marks += [(o, "D", "tab:red", f"published {o.candidate.recipe}") for _, o in res.recipes
              if o is not None and o.stage_peak_gib]
    for k, (o, marker, color, who) in enumerate(marks):
        if o is None:
            continue
        x, y = max(o.stage_peak_gib), o.iteration_s
        ax.scatter([x], [y], s=160, marker=marker, edgecolors="black", c=color, label=f"({k + 1}) {_label(o, who)}",
                   zorder=3)
        ax.annotate(str(k + 1), (x, y), xytext=(6, 6), textcoords="offset points", fontsize=8, weight="bold")
    if sims:
        ax.axvline(sims[0].budget_gib, color="tab:red", ls="--", lw=1, label="budget")
    ax.set_xlabel("peak memory of the fullest stage (GiB)")
    ax.set_ylabel("iteration time (s)")
    ax.set_title(f"{res.space.model.name}, {res.space.gpus} GPUs: candidates planned")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.12), ncol=1, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
