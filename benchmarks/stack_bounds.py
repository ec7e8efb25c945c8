"""How tight the search's time bounds are on a stack of layer kinds (decision 0259): DeepSeek-V3 (3 dense layers
under 58 MoE ones) on 1,024 H100, a few layouts of its search planned with lynx and bounded two ways.

    python benchmarks/stack_bounds.py --results benchmarks/results/stack_bounds.json

For each layout (`lynx plan --model deepseek-v3 --hardware h100-80g-nvlink --gpus 1024 --global-batch 8192
--seq-len 4096` searches them all, with Megatron's production overlaps): the any-split time bound the search's tree
reads (`bounds.time_bound_from`) with every layer priced as its own kind, the same bound with every layer priced as
the cheapest kind (what the tree read before decision 0259), and lynx's plan of the layout (`plan_candidate`, the
planner the search runs). Target: no bound above its plan (a lower bound, or the search could lose its optimum).
Deterministic; no timing is a figure here (config_search_deepseek.json has the search's time).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import replace

import _results
from _markdown import Out
from _targets import Targets
from rich.table import Table

from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.search import Pins, Space
from lynx.search.bounds import pieces, time_bound_from
from lynx.search.evaluate import Shared, plan_candidate
from lynx.search.space import Layout, layout_candidates
from lynx.spec import load_hardware

# (TP, EP, PP, VPP, DP, micro-batch): 1F1B at PP 1-16 and interleaved, the layouts the search's log visits first
LAYOUTS = [(2, 256, 1, 1, 512, 2), (2, 64, 2, 1, 256, 2), (2, 16, 4, 1, 128, 2), (2, 8, 8, 1, 64, 2),
           (2, 8, 16, 1, 32, 2), (4, 8, 8, 2, 32, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    _results.add_option(ap, "stack_bounds")
    a = ap.parse_args()
    run = _results.Run()
    out = Out(a.markdown)
    space = Space(load_model("deepseek-v3"), load_hardware("h100-80g-nvlink"), 1024, 8192, 4096, Pins(),
                  offload=False)
    shared = Shared(space, PlanOptions())
    tab = Table(title="DeepSeek-V3 / 1,024 H100: the search's any-split time bound against lynx's plan")
    for c in ("layout", "plan (s)", "bound, each layer its kind (s)", "/ plan", "bound, cheapest kind (s)", "/ plan"):
        tab.add_column(c, justify="left" if c == "layout" else "right")
    t = Targets()
    ratios_kind, ratios_min = [], []
    for tp, ep, pp, vpp, dp, mb in LAYOUTS:
        lay = Layout(tp=tp, pp=pp, vpp=vpp, dp=dp, sp=True, mb=mb, dist_opt=True, ep=ep, etp=1)
        cand = next(c for c in layout_candidates(space, lay)[0] if c.method == "lynx")
        o = plan_candidate(shared, cand, math.nan)
        problem = shared.problem(lay, None)
        p = pieces(problem)
        kind, cheapest = time_bound_from(p, vpp), time_bound_from(replace(p, above=()), vpp)
        if not o.fits:
            tab.add_row(lay.label(), "does not fit", f"{kind:.3f}", "", f"{cheapest:.3f}", "")
            continue
        ratios_kind.append(kind / o.iteration_s)
        ratios_min.append(cheapest / o.iteration_s)
        tab.add_row(lay.label(), f"{o.iteration_s:.3f}", f"{kind:.3f}", f"{kind / o.iteration_s:.3f}",
                    f"{cheapest:.3f}", f"{cheapest / o.iteration_s:.3f}")
    out.print(tab)
    out.print("every bound at most its plan (bound / plan <= 1): "
              + t.at_most("every bound at most its plan (each layer its kind; bound / plan, max)",
                          round(max(ratios_kind), 4), 1.0))
    figures = [
        *_results.figures_of(t),
        _results.Figure("layouts planned that fit", len(ratios_kind), "layouts"),
        _results.Figure("bound / plan, each layer its kind, median", round(statistics.median(ratios_kind), 4), "x"),
        _results.Figure("bound / plan, each layer its kind, min", round(min(ratios_kind), 4), "x"),
        _results.Figure("bound / plan, every layer the cheapest kind (before 0259), median",
                        round(statistics.median(ratios_min), 4), "x"),
        _results.Figure("bound / plan, every layer the cheapest kind (before 0259), min", round(min(ratios_min), 4),
                        "x"),
    ]
    run.write(a.results, "stack_bounds", "prediction", "The search's time bounds on a stack of layer kinds against "
              "lynx's plans (DeepSeek-V3 / 1,024 H100)", figures)
    if not all(c.holds for c in t.checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
