"""What `lynx plan --gpus N` shows: the top configurations, the fastest stock Megatron-Core one and the
published recipes for the job beside them, a few sentences on why the winner won, and every candidate as JSON
(the time-against-memory picture is `search.plot`)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from rich.table import Table

from lynx.search.evaluate import Outcome
from lynx.search.mfu import CONVENTION, causal_mfu, shows_causal
from lynx.search.options import PRODUCTION_OVERLAPS
from lynx.search.prices import ENGINE_WITHOUT_UB, RUNTIME_WITHOUT_UB
from lynx.search.run import SearchResult
from lynx.search.space import Layout, Stock, method_sets
from lynx.search.tree import Kind, Node, count

STOCK_WHAT = {Stock.MEGATRON: "its recompute flags on any split it expresses",
              Stock.TORCHTITAN: "its activation checkpointing: none, full or per-op selective, on any split"}
"""What a stock configuration of each framework is, in the explanation's words."""
STOCK_KEY = {Stock.MEGATRON: "stock_megatron", Stock.TORCHTITAN: "stock_torchtitan"}
"""--json's key for the framework's own settings (a candidate's flag and the result's fastest stock row)."""


def _layout_cells(o: Outcome, experts: bool = False) -> list[str]:
    lay = o.candidate.layout
    cp = str(lay.cp) if lay.cp == 1 or lay.cp_comm_type == "p2p" else f"{lay.cp} {lay.cp_comm_type}"
    ep = [str(lay.ep), str(lay.etp or lay.tp)] if experts else []
    return [str(lay.tp), cp, *ep, str(lay.pp), str(lay.vpp), str(lay.dp), "on" if lay.sp else "off", str(lay.mb),
            "fsdp" if lay.fsdp else "dist" if lay.dist_opt else "-"]


def _figures(o: Outcome, causal: bool, res: SearchResult) -> list[str]:
    peaks = " ".join(f"{p:.1f}" for p in o.stage_peak_gib)
    mfu = [f"{o.mfu:.1%}"] + ([f"{causal_mfu(res.space.model, res.space.seq_len, o.mfu):.1%}"] if causal else [])
    return [f"{o.iteration_s:.3f}", f"{o.tokens_per_s_per_gpu:,.0f}", f"{o.tflops_per_gpu:.0f}", *mfu,
            peaks, f"{o.headroom_gib:.1f}"]


def method_text(o: Outcome, stock: Stock = Stock.MEGATRON) -> str:
    """The method and where it runs: lynx's own, or the stock framework's with its split (and the recipe's name)."""
    c = o.candidate
    runs = f"{o.runs_on}, " if o.runs_on else ""  # priced for a target (`lynx.search.targets`): what the row needs
    if not c.stock:
        return f"{c.method} ({o.runs_on})" if o.runs_on else c.method
    split = "" if c.split.even else f", {c.split.label()}"
    return f"{c.method} ({runs}{c.recipe or 'stock ' + stock.value}{split})"


def search_table(res: SearchResult, top: int) -> Table:
    """The `top` fastest fitting candidates, then the fastest stock one (if not among them: `Space.stock`), then
    each published recipe for the job that runs (dimmed rows; # is the rank it would take)."""
    causal = shows_causal(res.space.model, res.space.seq_len)
    t = Table(title=f"{res.space.model.name} on {res.space.gpus} x {res.space.hardware.device.name}: "
              f"global batch {res.space.global_batch}, seq {res.space.seq_len} (fastest first)")
    experts = res.space.model.is_moe  # EP and ETP columns for MoE models only (dense tables unchanged)
    mfu_cols = ("MFU", "MFU causal") if causal else ("MFU",)
    for col in ("#", "TP", "CP", *(("EP", "ETP") if experts else ()), "PP", "VPP", "DP", "SP", "mb", "optimizer",
                "method", "iteration s", "tokens/s/GPU", "TFLOP/s/GPU", *mfu_cols, "peak GiB per stage",
                "headroom GiB"):
        t.add_column(col, justify="left" if col in ("method", "peak GiB per stage") else "right")
    rows = list(res.ranked[:top])
    for i, o in enumerate(rows, 1):
        t.add_row(str(i), *_layout_cells(o, experts), method_text(o, res.space.stock), *_figures(o, causal, res))
    extra = [o for o in (res.best_stock,) if o is not None and o not in rows]
    extra += [o for _, o in res.recipes if o is not None and o.fits]
    for o in extra:
        rank = sum(r.iteration_s < o.iteration_s for r in res.ranked) + 1
        t.add_row(str(rank), *_layout_cells(o, experts), method_text(o, res.space.stock), *_figures(o, causal, res),
                  style="dim")
    return t


def _pct(a: float, b: float) -> str:
    return f"{abs(a / b - 1):.1%}"


def _versus(best: Outcome, other: Outcome, what: str) -> str:
    lay = other.candidate.layout
    split = "" if other.candidate.split.even else f", {other.candidate.split.label()}"
    d = other.iteration_s / best.iteration_s - 1
    how = (f"the winner is {_pct(other.iteration_s, best.iteration_s)} faster" if d > 0 else
           "the same time" if d == 0 else f"{_pct(other.iteration_s, best.iteration_s)} faster than the winner")
    return f"{what} ({lay.label()}, {other.candidate.method}{split}) takes {other.iteration_s:.4g} s: {how}."


def assumptions(res: SearchResult) -> list[str]:
    """What every candidate was priced with, in Megatron's flags."""
    s = res.space
    out = []
    if s.stock is Stock.TORCHTITAN:  # the rows priced for torchtitan run its own overlaps, not Megatron's flags
        out.append("Priced for torchtitan: FSDP2 with its prefetch, tensor-parallel collectives exposed (no "
                   "--tp-comm-overlap: torchtitan's eager TP has no userbuffers); lynx's own ranking before the "
                   "finalists' torchtitan prices gives DDP layouts " + ", ".join(PRODUCTION_OVERLAPS[:2]) + ".")
    elif s.production_overlaps:
        out.append("Every candidate assumes Megatron's production overlaps: " + ", ".join(PRODUCTION_OVERLAPS)
                   + "; p2p sends are charged exposed (not modelled). --no-production-overlaps turns them off.")
        if any(o.runs_on == ENGINE_WITHOUT_UB for o in res.outcomes):
            out.append(f"Rows marked '{ENGINE_WITHOUT_UB}' are lynx's plans made again without --tp-comm-overlap: "
                       "lynx's engine builds Megatron-Core's local layer spec, which has no TransformerEngine "
                       "userbuffers, and the plan with the flag would run only by lynx's plugin (slower there, or "
                       "over memory); each row is the faster of the two, and its plan file is the one it prices.")
        if any(o.runs_on == RUNTIME_WITHOUT_UB for o in res.outcomes):
            out.append(f"Rows marked '{RUNTIME_WITHOUT_UB}' are lynx's plans made again without --tp-comm-overlap: "
                       "lynx's own runtime issues each tensor-parallel collective whole, never pipelined with the "
                       "GEMM as TransformerEngine's userbuffers are; each row's plan file is the one it prices.")
    else:
        out.append("Production overlaps off (--no-production-overlaps): only the overlap flags given are priced.")
    if shows_causal(s.model, s.seq_len):
        out.append(CONVENTION + ".")
    return out


def _workers(res: SearchResult) -> str:
    """How many processes searched (the answer is the same with one)."""
    if res.jobs <= 1:
        return ""
    handed, used = res.ahead
    workers = res.jobs - 1
    procs = f"{workers} worker process{'es' if workers > 1 else ''}"
    if res.beside and res.stopped:
        return (f" {procs} searched the tree beside this one and decided {res.beside:,} of the candidates, sharing "
                "the incumbents; what the processes reached before the time limit depends on timing.")
    if res.beside:
        return (f" {procs} searched the tree beside this one and decided {res.beside:,} of the candidates, sharing "
                f"the incumbents: the {res.rows} fastest rows, the stock row and the recipes are what --jobs 1 finds; "
                "which slower candidates were planned or pruned depends on when each process learnt the others' "
                "times.")
    return (f" {procs} took {handed} of lynx's candidates ahead of the search, which used {used} of their answers "
            "(--jobs 1 gives the same answer in one process).")


def pick_within(res: SearchResult, best: Outcome) -> float | None:
    """How much slower than the target's fastest the pick can be at most: candidates the target did not price run at
    least `priced_floor_s` in lynx's pricing, and a target runs a candidate no faster than lynx prices it (decision
    0278). 0: the pick is the fastest there; None: not ranked for a target, or a stopped tree (it says its own gap)."""
    floor = res.priced_floor_s
    if math.isnan(floor) or not best.priced_for or res.stopped:
        return None
    return max(0.0, best.iteration_s / floor - 1)


def _priced_floor(res: SearchResult, best: Outcome) -> list[str]:
    """`pick_within` in words."""
    gap, floor, target = pick_within(res, best), res.priced_floor_s, best.priced_for
    if gap is None:
        return []
    if math.isinf(floor):
        return [f"Every fitting candidate was priced for {target}: the pick is the fastest there."]
    if gap == 0:
        return [f"The pick is the fastest on {target}: every candidate not priced for it takes at least {floor:.4g} s "
                "in lynx's pricing, which a target does not beat."]
    return [f"The pick is at most {gap:.1%} slower than the fastest on {target} could be: candidates not priced for "
            f"it take at least {floor:.4g} s in lynx's pricing, which a target does not beat (a larger --top prices "
            "more of them)."]


def _stopped(res: SearchResult) -> list[str]:
    """Where the time limit stopped the tree: what it left, and how far the pick can be from the best of that."""
    if not res.stopped:
        return []
    line = (f"The search stopped at its time limit ({res.time_limit_s:g} s, --search-time-limit; 0 for none) with "
            f"{res.unplanned:,} candidates not planned; by their time bounds none runs faster than "
            f"{res.open_bound_s:.4g} s in lynx's pricing")
    best = res.best_lynx_s
    if math.isnan(best):
        return [line + ", and none of those planned fits."]
    if best <= res.open_bound_s:
        return [line + f", so the fastest found ({best:.4g} s) is the fastest there is."]
    return [line + f": the fastest found ({best:.4g} s) is at most {best / res.open_bound_s - 1:.1%} slower than "
            "the best one could be (a longer limit narrows that)."]


def explain(res: SearchResult) -> list[str]:
    """A few sentences in the user's terms: what was searched, what won and by how much over the fastest stock
    configuration (Megatron-Core's, or torchtitan's for its target) and over the published recipe, and what the
    winner's own choices buy."""
    best, stock, recipe = res.best, res.best_stock, res.best_recipe
    stock_of = res.space.stock
    out = [f"Searched {res.considered} candidates in {res.seconds:.1f} s: {res.planned} planned ({res.simulated} "
           f"simulated); skipped {res.pruned}: {res.skipped + res.count('pruned (time bound)')} by time bounds and "
           f"{res.over_memory_bound} by memory bounds (neither loses the optimum), "
           f"{res.count('dominated')} dominated by a cheaper method that fits, {res.count('skipped (VPP sweep)')} by "
           "the VPP sweep (a rule: deeper interleaving of the layout had got slower)." + _workers(res),
           *_stopped(res), *assumptions(res)]
    if best is None:
        if res.stopped:  # what it left may fit: nothing is known about the memory of candidates never planned
            return [*out, "None of the candidates planned before the time limit fits; a longer --search-time-limit "
                    "plans the rest."]
        return [*out, "No configuration fits the memory budget; more GPUs or a shorter sequence are needed."]
    lay = best.candidate.layout
    out.append(f"The fastest that fits is {lay.label()} with {method_text(best, stock_of)}: {best.iteration_s:.4g} s "
               f"per iteration, {best.mfu:.1%} MFU, {best.headroom_gib:.1f} GiB headroom on its fullest stage.")
    out += _priced_floor(res, best)
    if stock is not None and stock is not best:
        out.append(_versus(best, stock, f"The fastest stock {stock_of.value} configuration"))
    elif stock is None and not method_sets(res.space)[1]:  # --method pinned to non-stock methods only
        out.append(f"No stock {stock_of.value} configuration was searched (--method pins the methods).")
    elif stock is None:
        out.append(f"No stock {stock_of.value} configuration ({STOCK_WHAT[stock_of]}) fits.")
    out += _recipe_lines(res, best, recipe)
    out += _neighbours(res, best)
    return out


def _recipe_lines(res: SearchResult, best: Outcome, recipe: Outcome | None) -> list[str]:
    out = []
    for a, o in res.recipes:
        if o is None:
            out.append(f"Published recipe {a.recipe.name} does not run this job: {a.reason}.")
        elif not o.fits:
            out.append(f"Published recipe {a.recipe.name} ({o.candidate.layout.label()}, {o.candidate.method}) "
                       f"does not fit: {o.reason or o.status}.")
    if recipe is not None:
        out.append(_versus(best, recipe, f"The published recipe {recipe.candidate.recipe}"))
    return out


def _neighbours(res: SearchResult, best: Outcome) -> list[str]:
    """One sentence per dimension of the winner whose flip changes memory or time noticeably."""
    lay, out = best.candidate.layout, []
    by_key = {(o.candidate.layout, o.candidate.method, o.candidate.split): o for o in res.outcomes
              if not o.candidate.recipe}
    c = best.candidate
    for field, text in (("sp", "sequence parallelism"), ("dist_opt", "the distributed optimizer")):
        if not getattr(lay, field):
            continue
        other = by_key.get((_flip(lay, field), c.method, c.split))
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
        elif other.status in ("does not fit", "over budget (bound)"):
            why = other.reason.split(":")[0] if other.reason else other.status
            out.append(f"Without {text} this layout does not fit ({why}).")
    if c.method == "lynx":
        none = next((o for k, o in by_key.items() if k[0] == lay and k[1] == "none"), None)
        if none is not None and not none.fits:
            out.append("Keeping every activation does not fit this layout; lynx recomputes a little, mostly "
                       "hidden in tensor-parallel collectives and pipeline stalls.")
    return out


def _flip(lay: Layout, field: str) -> Layout:
    return replace(lay, sp=not lay.sp) if field == "sp" else replace(lay, dist_opt=not lay.dist_opt)


def outcome_dict(o: Outcome, res: SearchResult | None = None, stock: Stock = Stock.MEGATRON) -> dict[str, Any]:
    """One candidate for --json: `stock_megatron` (or `stock_torchtitan`, `Space.stock`) marks the framework's own
    settings."""
    c = o.candidate
    if res is not None:
        stock = res.space.stock
    lay = c.layout
    d: dict[str, Any] = {"tp": lay.tp, "cp": lay.cp, "cp_comm_type": lay.cp_comm_type,
                         **({"ep": lay.ep, "etp": lay.etp or lay.tp} if lay.ep > 1 or lay.etp else {}),
                         "pp": lay.pp, "vpp": lay.vpp, "dp": lay.dp, "sp": lay.sp, "micro_batch": lay.mb,
                         "distributed_optimizer": lay.dist_opt, "fsdp": lay.fsdp, "method": c.method,
                         STOCK_KEY[stock]: c.stock,
                         "status": o.status, "time_bound_s": None if math.isnan(o.bound_s) else o.bound_s,
                         "priced_for": o.priced_for}
    if o.runs_on:
        d["runs_on"] = o.runs_on
    if c.stock and stock is Stock.MEGATRON:
        d["megatron_split"] = c.split.flags()
    if c.recipe:
        d["recipe"] = c.recipe
    if o.reason:
        d["reason"] = o.reason
    if not math.isnan(o.iteration_s):
        d |= {"iteration_s": o.iteration_s, "tokens_per_s_per_gpu": o.tokens_per_s_per_gpu,
              "model_tflops_per_gpu": o.tflops_per_gpu, "mfu": o.mfu, "stage_peak_gib": list(o.stage_peak_gib),
              "budget_gib": o.budget_gib, "headroom_gib": o.headroom_gib, "partition": list(o.partition)}
        if res is not None:
            d["mfu_causal"] = causal_mfu(res.space.model, res.space.seq_len, o.mfu)
    return d


def result_dict(res: SearchResult) -> dict[str, Any]:
    best, stock = res.best, res.best_stock
    return {
        "model": res.space.model.name, "hardware": res.space.hardware.name, "gpus": res.space.gpus,
        "global_batch": res.space.global_batch, "seq_len": res.space.seq_len,
        "production_overlaps": res.space.production_overlaps, "mfu_convention": CONVENTION,
        "considered": res.considered, "planned": res.planned, "simulated": res.simulated, "pruned": res.pruned,
        "skipped_unbuilt": res.skipped,
        "seconds": res.seconds,
        "stage_problems_solved": res.stage_problems, "stage_problem_cache_hits": res.stage_hits,
        "jobs": res.jobs, "planned_ahead": {"handed_out": res.ahead[0], "used": res.ahead[1]},
        "decided_by_workers": res.beside, "exact_rows": res.rows,
        "time_limit_s": res.time_limit_s, "stopped_at_time_limit": res.stopped, "not_planned": res.unplanned,
        "open_bound_s": None if math.isnan(res.open_bound_s) else res.open_bound_s,
        "fastest_in_lynx_pricing_s": None if math.isnan(res.best_lynx_s) else res.best_lynx_s,
        "unpriced_at_least_s": res.priced_floor_s if math.isfinite(res.priced_floor_s) else None,
        "pick_within": None if best is None else pick_within(res, best),
        "winner": outcome_dict(best, res) if best else None,
        STOCK_KEY[res.space.stock]: outcome_dict(stock, res) if stock else None,
        "recipes": [{"name": a.recipe.name, "source": a.recipe.source, "reason": a.reason,
                     "outcome": None if o is None else outcome_dict(o, res)} for a, o in res.recipes],
        "explanation": explain(res),
        # the `skipped_unbuilt` ones are not listed
        "candidates": [outcome_dict(o, stock=res.space.stock) for o in res.outcomes],
        "rejected": [{"what": r.what, "reason": r.reason} for r in res.rejected],
        # layouts whose static memory alone is over budget: their candidates are counted, not listed
        "refused": [{"what": core.layout.label().replace(" VPP1", " (every VPP)"), "reason": why,
                     "candidates": count(res.space, Node(Kind.CORE, core))} for core, why in res.refused],
    }
