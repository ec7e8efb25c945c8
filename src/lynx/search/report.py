"""What `lynx plan --gpus N` shows: the top configurations beside the fastest stock Megatron-Core one, a few
sentences on why the winner won, every candidate as JSON, and the time-against-memory picture."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.table import Table

from lynx.search.evaluate import Outcome
from lynx.search.run import SearchResult


def _layout_cells(o: Outcome, experts: bool = False) -> list[str]:
    lay = o.candidate.layout
    ep = [str(lay.ep), str(lay.etp or lay.tp)] if experts else []
    return [str(lay.tp), str(lay.cp), *ep, str(lay.pp), str(lay.vpp), str(lay.dp), "on" if lay.sp else "off",
            str(lay.mb), "dist" if lay.dist_opt else "-"]


def _figures(o: Outcome) -> list[str]:
    peaks = " ".join(f"{p:.1f}" for p in o.stage_peak_gib)
    return [f"{o.iteration_s:.3f}", f"{o.tokens_per_s_per_gpu:,.0f}", f"{o.tflops_per_gpu:.0f}", f"{o.mfu:.1%}",
            peaks, f"{o.headroom_gib:.1f}"]


def search_table(res: SearchResult, top: int) -> Table:
    """The `top` fastest fitting candidates, then the fastest stock Megatron-Core one (if not among them)."""
    t = Table(title=f"{res.space.model.name} on {res.space.gpus} x {res.space.hardware.device.name}: "
              f"global batch {res.space.global_batch}, seq {res.space.seq_len} (fastest first)")
    experts = res.space.model.is_moe  # EP and ETP columns for MoE models only (dense tables unchanged)
    for col in ("#", "TP", "CP", *(("EP", "ETP") if experts else ()), "PP", "VPP", "DP", "SP", "mb", "optimizer",
                "method", "iteration s", "tokens/s/GPU", "TFLOP/s/GPU", "MFU", "peak GiB per stage", "headroom GiB"):
        t.add_column(col, justify="left" if col in ("method", "peak GiB per stage") else "right")
    rows = list(res.ranked[:top])
    stock = res.best_stock
    for i, o in enumerate(rows, 1):
        t.add_row(str(i), *_layout_cells(o, experts), _method(o), *_figures(o))
    if stock is not None and stock not in rows:
        rank = res.ranked.index(stock) + 1
        t.add_row(str(rank), *_layout_cells(stock, experts), _method(stock), *_figures(stock), style="dim")
    return t


def _method(o: Outcome) -> str:
    return f"{o.candidate.method} (stock Megatron-Core)" if o.candidate.stock else o.candidate.method


def _pct(a: float, b: float) -> str:
    return f"{abs(a / b - 1):.1%}"


def explain(res: SearchResult) -> list[str]:
    """A few sentences in the user's terms: what was searched, what won and by how much over stock
    Megatron-Core, and what the winner's own choices buy (from the candidates that differ in one dimension)."""
    best, stock = res.best, res.best_stock
    out = [f"Searched {res.considered} candidates: {res.planned} planned ({res.simulated} simulated), "
           f"{res.pruned} skipped by bounds that cannot lose the optimum, in {res.seconds:.1f} s."]
    if best is None:
        return [*out, "No configuration fits the memory budget; more GPUs or a shorter sequence are needed."]
    lay = best.candidate.layout
    out.append(f"The fastest that fits is {lay.label()} with {best.candidate.method}: {best.iteration_s:.3g} s per "
               f"iteration, {best.mfu:.1%} MFU, {best.headroom_gib:.1f} GiB headroom on its fullest stage.")
    if stock is not None and stock is not best:
        out.append(f"The fastest stock Megatron-Core configuration ({stock.candidate.layout.label()}, "
                   f"{stock.candidate.method}, even split) takes {stock.iteration_s:.3g} s: the winner is "
                   f"{_pct(stock.iteration_s, best.iteration_s)} faster.")
    elif stock is None:
        out.append("No stock Megatron-Core configuration (even split, its own recompute flags) fits.")
    out += _neighbours(res, best)
    return out


def _neighbours(res: SearchResult, best: Outcome) -> list[str]:
    """One sentence per dimension of the winner whose flip changes memory or time noticeably."""
    lay, out = best.candidate.layout, []
    by_key = {(o.candidate.layout, o.candidate.method): o for o in res.outcomes}
    for field, text in (("sp", "sequence parallelism"), ("dist_opt", "the distributed optimizer")):
        if not getattr(lay, field):
            continue
        other = by_key.get((_flip(lay, field), best.candidate.method))
        if other is None:
            continue
        if other.fits:
            freed = max(other.stage_peak_gib) - max(best.stage_peak_gib)
            dt = best.iteration_s / other.iteration_s - 1
            how = f"costs {dt:.1%} time" if dt > 0 else f"runs {-dt:.1%} faster"
            if freed > 0.05:
                out.append(f"{text.capitalize()} frees {freed:.1f} GiB on the fullest stage and {how}.")
            else:  # no memory freed on the fullest stage: lynx kept more activations there, or none needed it
                out.append(f"{text.capitalize()} {how} at about the same peak memory.")
        else:
            why = other.reason.split(":")[0] if other.reason else other.status
            out.append(f"Without {text} this layout does not fit ({why}).")
    if best.candidate.method == "lynx":
        none = by_key.get((lay, "none"))
        if none is not None and not none.fits:
            out.append("Keeping every activation does not fit this layout; lynx recomputes a little, mostly "
                       "hidden in tensor-parallel collectives and pipeline stalls.")
    return out


def _flip(lay: Any, field: str) -> Any:
    from dataclasses import replace

    return replace(lay, **{field: not getattr(lay, field)})


def outcome_dict(o: Outcome) -> dict[str, Any]:
    lay = o.candidate.layout
    d: dict[str, Any] = {"tp": lay.tp, "cp": lay.cp, **({"ep": lay.ep, "etp": lay.etp or lay.tp}
                                                       if lay.ep > 1 or lay.etp else {}),
                         "pp": lay.pp, "vpp": lay.vpp, "dp": lay.dp, "sp": lay.sp,
                         "micro_batch": lay.mb, "distributed_optimizer": lay.dist_opt,
                         "method": o.candidate.method, "stock_megatron": o.candidate.stock, "status": o.status,
                         "time_bound_s": None if math.isnan(o.bound_s) else o.bound_s}
    if o.reason:
        d["reason"] = o.reason
    if not math.isnan(o.iteration_s):
        d |= {"iteration_s": o.iteration_s, "tokens_per_s_per_gpu": o.tokens_per_s_per_gpu,
              "model_tflops_per_gpu": o.tflops_per_gpu, "mfu": o.mfu, "stage_peak_gib": list(o.stage_peak_gib),
              "budget_gib": o.budget_gib, "headroom_gib": o.headroom_gib, "partition": list(o.partition)}
    return d


def result_dict(res: SearchResult) -> dict[str, Any]:
    best, stock = res.best, res.best_stock
    return {
        "model": res.space.model.name, "hardware": res.space.hardware.name, "gpus": res.space.gpus,
        "global_batch": res.space.global_batch, "seq_len": res.space.seq_len,
        "considered": res.considered, "planned": res.planned, "simulated": res.simulated, "pruned": res.pruned,
        "seconds": res.seconds,
        "stage_problems_solved": res.stage_problems, "stage_problem_cache_hits": res.stage_hits,
        "winner": outcome_dict(best) if best else None, "stock_megatron": outcome_dict(stock) if stock else None,
        "explanation": explain(res),
        "candidates": [outcome_dict(o) for o in res.outcomes],
        "rejected": [{"what": r.what, "reason": r.reason} for r in res.rejected],
    }


def scatter_png(res: SearchResult, path: Path) -> None:
    """Iteration time against the fullest stage's peak memory for every simulated candidate; the budget as
    a line, the winner and the stock Megatron-Core configuration marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sims = [o for o in res.outcomes if o.stage_peak_gib]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fits, color, label in ((True, "tab:blue", "fits"), (False, "tab:gray", "does not fit")):
        pts = [o for o in sims if o.fits == fits]
        ax.scatter([max(o.stage_peak_gib) for o in pts], [o.iteration_s for o in pts], s=8, c=color,
                   alpha=0.6, label=label)
    for o, marker, label in ((res.best_stock, "s", "stock Megatron-Core"), (res.best, "*", "lynx's pick")):
        if o is not None:
            ax.scatter([max(o.stage_peak_gib)], [o.iteration_s], s=160, marker=marker, edgecolors="black",
                       c="tab:orange" if marker == "*" else "tab:green", label=label, zorder=3)
    if sims:
        ax.axvline(sims[0].budget_gib, color="tab:red", ls="--", lw=1, label="budget")
    ax.set_xlabel("peak memory of the fullest stage (GiB)")
    ax.set_ylabel("iteration time (s)")
    ax.set_title(f"{res.space.model.name}, {res.space.gpus} GPUs: candidates planned")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
