"""Does the configuration search's pick beat the published one? The Megatron-LM README's weak-scaling rows.

For each row of `benchmarks/megatron_readme.py` (GPT 1.7B-462B on H100, sequence 4096, vocabulary 131,072, the
published TP/PP with DP 48, Megatron-Core r0.8.0 with its data-parallel overlaps): the published layout is priced
with every stock Megatron-Core recompute flag (none among them) and the best of those is shown beside the search's
pick for the same model, GPUs and global batch. Both use Megatron's bf16 recipe with the overlaps the README
names (`--overlap-grad-reduce --overlap-param-gather`; `--tp-comm-overlap` where TP > 1 is left to each layout's
default, off, so the two sides are priced alike). Both sides keep micro-batch 1 and 1F1B without interleaving
(like for like; `megatron_readme.py` prices the published rows with its documented schedule instead), and the
search searches TP, PP, DP, SP, the distributed optimizer and the method.

    python benchmarks/readme_search.py [--rows 1.7B,7.1B,...]

Target (issue 19): the pick is predicted at least as fast as the published configuration, for every row.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import _results
from megatron_readme import DP, ROWS, SEQ, Row, model_of

from lynx.problem import PlanOptions
from lynx.search import Pins, Space, search
from lynx.spec import load_hardware

FIGURES: list[_results.Figure] = []
"""Each row's pick against the published layout, for `--results`."""


def run_row(r: Row) -> tuple[bool, str]:
    hw = load_hardware("h100-80g-nvlink")
    gpus = r.tp * r.pp * DP
    opts = PlanOptions(precision="megatron-bf16", overlap_grad_reduce=True, overlap_param_gather=True)
    pins = Pins(mb=1, vpp=1)
    t0 = time.perf_counter()
    res = search(Space(model_of(r), hw, gpus, r.global_batch, SEQ, pins), opts)
    pub = search(Space(model_of(r), hw, gpus, r.global_batch, SEQ,
                       Pins(tp=r.tp, pp=r.pp, vpp=1, mb=1, sp=r.tp > 1, dist_opt=True)), opts, exhaustive=True)
    wall = time.perf_counter() - t0
    stock, best = pub.best_stock, res.best
    if stock is None or best is None:
        return False, f"| {r.name} | {gpus} | {'no stock flag fits' if stock is None else '-'} | - | - | - | no |"
    holds = best.iteration_s <= stock.iteration_s * (1 + 1e-9)
    FIGURES.append(_results.Figure(
        f"{r.name}, {gpus} GPUs: the search's pick {best.candidate.layout.label()} {best.candidate.method}",
        round(best.iteration_s, 3), "s",
        f"<= published layout {stock.candidate.layout.label()} {stock.candidate.method} {stock.iteration_s:.3f} s",
        holds))
    return holds, (f"| {r.name} | {gpus} | {stock.candidate.layout.label()} {stock.candidate.method} "
                   f"{stock.iteration_s:.3f} s | {best.candidate.layout.label()} {best.candidate.method} "
                   f"{best.iteration_s:.3f} s | {stock.iteration_s / best.iteration_s - 1:+.1%} | {wall:.1f} | "
                   f"{'yes' if holds else 'NO'} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="", help="comma-separated row names (default: every row)")
    _results.add_option(ap, "readme_search")
    a = ap.parse_args()
    run = _results.Run()
    names = [n for n in a.rows.split(",") if n] or [r.name for r in ROWS]
    unknown = sorted(set(names) - {r.name for r in ROWS})
    if unknown:
        print(f"readme_search.py: error: --rows: unknown {', '.join(unknown)}; valid: "
              f"{', '.join(r.name for r in ROWS)}", file=sys.stderr)
        return 2
    print(f"load average {os.getloadavg()[0]:.2f} (2-core VM)")
    print("| row | GPUs | published layout, best stock flag, predicted | lynx's pick, predicted | pick faster by | "
          "search s | target: pick <= published |")
    print("|---|---:|---|---|---:|---:|---|")
    ok = True
    for r in ROWS:
        if r.name in names:
            holds, line = run_row(r)
            ok &= holds
            print(line, flush=True)
    print(f"targets: {'all hold' if ok else 'some DO NOT HOLD'}; load average after {os.getloadavg()[0]:.2f}")
    run.write(a.results, "readme_search", "prediction", "The configuration search's pick against the published "
              "Megatron-LM README layouts (predicted step times)", FIGURES)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
