"""The paper's breakdown (sec. 7.3): throughput with HEU alone (dp partitioning, `lynx-heu`) versus HEU +
recomputation-aware partitioning (`lynx`), as shares of lynx's gain over Megatron full recomputation; and
recomputation time on the critical path, lynx versus full (summed over stages, per iteration).

Targets (paper): HEU 77% / partitioning 23% of the gain on average; +recomputation 1.19-1.3x and +All
1.25-1.35x over full; critical-path recomputation 71-94% lower than full.
Run: python benchmarks/breakdown.py [--models gpt-7b,gpt-13b] (same grid as paper_grid.py)
"""

from __future__ import annotations

import argparse
import statistics
import time

from _markdown import Out
from paper_grid import MODELS, grid, grid_problem
from rich.table import Table

from lynx.api import plan
from lynx.errors import InfeasibleError


def crit(pl: object) -> float:
    return sum(st.recompute_critical_s for st in pl.sim.stages)  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--markdown", action="store_true", help="Print tables as markdown.")
    args = ap.parse_args()
    t0 = time.perf_counter()
    t = Table(title="breakdown: HEU alone (dp partitioning) vs HEU + partitioning, and critical recomputation",
              title_justify="left")
    for c in ("model", "cluster", "mb", "full samp/s", "+HEU", "+All (lynx)", "HEU share", "part. share",
              "crit full (s)", "crit lynx (s)", "crit reduction"):
        t.add_column(c, justify="left" if c in ("model", "cluster") else "right")
    shares: list[float] = []
    reductions: list[float] = []
    heu_x: list[float] = []
    all_x: list[float] = []
    for model, hw, tp, mb in grid(tuple(args.models.split(","))):
        prob = grid_problem(model, hw, tp, mb)
        full = plan(prob, "full")
        try:
            heu, lynx = plan(prob, "lynx-heu"), plan(prob, "lynx")
        except InfeasibleError:
            continue
        if full.sim.oom:
            continue
        f, h, a = full.sim.samples_per_s, heu.sim.samples_per_s, lynx.sim.samples_per_s
        gain = a - f
        share = (h - f) / gain if gain > 0 else float("nan")
        red = 1 - crit(lynx) / crit(full) if crit(full) > 0 else float("nan")
        if gain > 0:
            shares.append(share)
        reductions.append(red)
        heu_x.append(h / f)
        all_x.append(a / f)
        t.add_row(model, hw.removeprefix("a100-40g-"), str(mb), f"{f:.2f}", f"{h / f:.3f}x", f"{a / f:.3f}x",
                  f"{share:.0%}", f"{1 - share:.0%}", f"{crit(full):.3f}", f"{crit(lynx):.3f}", f"{red:.0%}")
    con = Out(args.markdown)
    con.print(t)
    s = Table(title="summary (cells where full fits and lynx finds a plan)", title_justify="left")
    for c in ("quantity", "measured", "paper (target)"):
        s.add_column(c)
    s.add_row("HEU share of the gain (mean)", f"{statistics.mean(shares):.0%}", "77%")
    s.add_row("partitioning share of the gain (mean)", f"{1 - statistics.mean(shares):.0%}", "23%")
    s.add_row("+HEU over full (range)", f"{min(heu_x):.2f}x-{max(heu_x):.2f}x", "1.19x-1.3x")
    s.add_row("+All over full (range)", f"{min(all_x):.2f}x-{max(all_x):.2f}x", "1.25x-1.35x")
    s.add_row("critical recomputation vs full (range)", f"{min(reductions):.0%}-{max(reductions):.0%} less",
              "71%-94% less")
    con.print(s)
    con.print(f"{len(heu_x)} cells in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
