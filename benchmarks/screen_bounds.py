"""How tight the search's screen bounds are (decision 0255): every interleaved lynx screen whose bound the
Llama-3-70B / 64 H100 search solved, bounded and then planned.

    python benchmarks/screen_bounds.py --results benchmarks/results/screen_bounds.json

It runs `lynx plan --model llama3-70b --hardware h100-80g-nvlink --gpus 64 --global-batch 128 --seq-len 8192
--jobs 1` (`benchmarks/config_search.py`'s 70B case) in this process and keeps the tree's `Frontier`, the
(layout, method) pairs it asked a screen bound for, and the status of every LP the floors solved. Then, for each
pair: the full screen bound (every stage's full floor, no early stop), the plain bound (keeping every activation on
the dp split, `plain_s`) and the screen itself (`plan_candidate` without refinement, what the tree compares with
the incumbents). Printed: how far each bound sits below the screen, how many screen bounds are above the plain
one, the cheap floors against the full ones, and how many LPs HiGHS ended in error. Target: no screen bound above
its screen (a lower bound, or the search could lose its optimum). Deterministic but for the LP statuses' order;
no timing is a figure here (config_search.json has the search's time).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import statistics
import sys
from typing import Any

import _results
from _markdown import Out
from _targets import Targets
from rich.table import Table

import lynx.milp as milp
import lynx.search.tree as tree
from lynx.cli import main as main_cli
from lynx.methods.common import base_partition
from lynx.search.bounds import plain_s
from lynx.search.evaluate import plan_candidate

COMMAND = ["plan", "--model", "llama3-70b", "--hardware", "h100-80g-nvlink", "--gpus", "64", "--global-batch", "128",
           "--seq-len", "8192", "--json", "--jobs", "1"]


def capture() -> tuple[tree.Frontier, list[tuple[tree.Node, str]], list[tuple[str, bool]], dict[str, Any]]:
    """The search's frontier, the (node, method) pairs it bounded, (status, presolve off) of every LP solved, and
    the search's JSON."""
    frontiers: list[tree.Frontier] = []
    asked: dict[tuple[object, str], tuple[tree.Node, str]] = {}
    lps: list[tuple[str, bool]] = []
    init, bound, solve = tree.Frontier.__init__, tree.Frontier.screen_bound, milp.Milp.solve

    def init_kept(self: tree.Frontier, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        frontiers.append(self)

    def bound_kept(self: tree.Frontier, node: tree.Node, method: str, *a: Any, **kw: Any) -> float:
        asked.setdefault((node.layout, method), (node, method))
        return bound(self, node, method, *a, **kw)

    def solve_kept(self: milp.Milp, *a: Any, **kw: Any) -> milp.MilpSolution:
        sol = solve(self, *a, **kw)
        if not any(self.integer):
            lps.append((sol.status, bool(kw.get("highs_options"))))
        return sol

    tree.Frontier.__init__ = init_kept  # type: ignore[method-assign]
    tree.Frontier.screen_bound = bound_kept  # type: ignore[method-assign]
    milp.Milp.solve = solve_kept  # type: ignore[method-assign]
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
            main_cli(COMMAND)
    finally:
        tree.Frontier.__init__ = init  # type: ignore[method-assign]
        tree.Frontier.screen_bound = bound  # type: ignore[method-assign]
        milp.Milp.solve = solve  # type: ignore[method-assign]
    return frontiers[-1], list(asked.values()), lps, json.loads(text.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    _results.add_option(ap, "screen_bounds")
    a = ap.parse_args()
    run = _results.Run()
    out = Out(a.markdown)
    frontier, asked, lps, found = capture()
    screens = [c for c in found["candidates"] if c["vpp"] > 1 and c["method"] in ("lynx", "lynx-offload")]
    planned = sum(c["status"] in ("planned", "does not fit") for c in screens)
    first = [s for s, retry in lps if not retry]
    retried = [s for s, retry in lps if retry]
    rows = []  # (method, bound, plain, screen)
    cheap_vs_full = []
    for node, method in asked:
        assert node.layout is not None
        cand = next((c for c in frontier.candidates(node) if c.method == method), None)
        if cand is None:
            continue
        o = plan_candidate(frontier.shared, cand, math.nan)
        if not o.fits:
            continue
        problem = frontier.shared.problem(node.layout, None)
        part = base_partition(problem)
        plain_b = plain_s(problem, part)  # the node's bound before the floors; the tree takes the larger of the two
        rows.append((method, max(plain_b, frontier.screen_bound(node, method)), plain_b, o.iteration_s))
        cache = frontier.shared.heu_cache(problem, node.layout, method)
        for ctx in problem.stage_contexts(part):
            full = cache.floor(ctx)
            if full > 0:
                cheap_vs_full.append(cache.floor(ctx, cheap=True) / full)
    t = Targets()
    below = [b / s for _, b, _, s in rows]
    plain = [p / s for _, _, p, s in rows]
    above_plain = sum(b > p for _, b, p, _ in rows)  # where the floors tighten the bound
    tab = Table(title=f"Screen bounds of the Llama-3-70B / 64 H100 search ({len(rows)} interleaved screens that fit)")
    for c in ("bound / screen", "min", "median", "max"):
        tab.add_column(c, justify="left" if c == "bound / screen" else "right")
    tab.add_row("screen bound (LP floors, at least the plain one)", f"{min(below):.3f}",
                f"{statistics.median(below):.3f}", f"{max(below):.3f}")
    tab.add_row("plain bound (keeping everything)", f"{min(plain):.3f}", f"{statistics.median(plain):.3f}",
                f"{max(plain):.3f}")
    tab.add_row("cheap floor / full floor (stages)", f"{min(cheap_vs_full):.3f}",
                f"{statistics.median(cheap_vs_full):.3f}", f"{max(cheap_vs_full):.3f}")
    out.print(tab)
    first_bad, retry_bad = sum(s != "optimal" for s in first), sum(s != "optimal" for s in retried)
    out.print(f"the search planned {planned} interleaved lynx screens (of {found['planned']} candidates)")
    out.print(f"{above_plain} of {len(rows)} screen bounds above the plain bound; floor LPs in the search: "
              f"{len(first)} solved, {first_bad} not optimal with presolve, {retry_bad} of those not optimal "
              "without it either (their floor is 0)")
    out.print("every screen bound at most its screen (bound / screen <= 1): "
              + t.at_most("every screen bound at most its screen (bound / screen, max)", round(max(below), 4), 1.0))
    figures = [
        *_results.figures_of(t),
        _results.Figure("interleaved lynx screens the search planned", planned, "screens"),
        _results.Figure("candidates the search planned", found["planned"], "candidates"),
        _results.Figure("interleaved screens bounded, then planned here", len(rows), "screens"),
        _results.Figure("screen bounds above the plain bound", above_plain, "screens"),
        _results.Figure("screen bound / screen, median", round(statistics.median(below), 4), "x"),
        _results.Figure("screen bound / screen, min", round(min(below), 4), "x"),
        _results.Figure("plain bound / screen, median", round(statistics.median(plain), 4), "x"),
        _results.Figure("plain bound / screen, min", round(min(plain), 4), "x"),
        _results.Figure("cheap floor / full floor, median over stages", round(statistics.median(cheap_vs_full), 4),
                        "x"),
        _results.Figure("cheap floor / full floor, min over stages", round(min(cheap_vs_full), 4), "x"),
        _results.Figure("floor LPs solved in the search (first try, with presolve)", len(first), "LPs"),
        _results.Figure("of those, not optimal with presolve", first_bad, "LPs"),
        _results.Figure("of those, not optimal without presolve either (floor 0)", retry_bad, "LPs"),
    ]
    run.write(a.results, "screen_bounds", "prediction", "The search's screen bounds against the screens they bound "
              "(Llama-3-70B / 64 H100)", figures)
    if not all(c.holds for c in t.checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
