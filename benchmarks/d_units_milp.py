"""HiGHS time of Lynx-HEU's interleaved offloading stage MILPs with their variable D in bytes (as the models were
built before decision 0271) and in GiB (`policy.heu.D_UNIT`, as built now), on the same models side by side.

    python benchmarks/d_units_milp.py --results benchmarks/results/d_units_milp.json

It runs `lynx plan --model llama3.1-405b --hardware h100-80g-nvlink --gpus 1024 --global-batch 2048 --seq-len 8192
--jobs 1` (`benchmarks/config_search.py`'s 405B case) in this process and keeps every stage MILP the search solves
that has D (the held bytes beyond the first live vector of an interleaved stage with offloading), then solves each
again three ways, with the search's gap and HiGHS options, rotating which goes first model by model so the
machine's drift falls on all alike: D in bytes (its coefficient 1 beside bytes of ~1e10), D in GiB as built, and
D in GiB row-scaled (`Milp.row_scaled`, as the LP floors are solved; reported, no target). Printed: each way's
sum and slowest solve and how far the objectives move (each solve stops within its model's relative gap, so the
ways may stop at different answers inside it). Targets: D in GiB takes at most 80% of D in bytes' sum, and no
objective moves by more than its gap. HiGHS runs one thread; the search's own time is config_search.json's figure.
"""

from __future__ import annotations

import argparse
import sys
import time

import _milp_capture
import _results
from rich.console import Console
from rich.table import Table

import lynx.milp as milp
from lynx.policy.heu import D_UNIT

SHARE_TARGET = 0.8
COMMAND = ["plan", "--model", "llama3.1-405b", "--hardware", "h100-80g-nvlink", "--gpus", "1024", "--global-batch",
           "2048", "--seq-len", "8192", "--precision", "megatron-bf16", "--json", "--jobs", "1"]

def capture() -> list[_milp_capture.Kept]:
    """Each stage MILP with D the search solves, as built, with its gap and HiGHS options."""
    return _milp_capture.capture(COMMAND, lambda m, gap: any(m.integer) and "D" in m.names)


def in_bytes(m: milp.Milp) -> milp.Milp:
    """The model with D in bytes: its column's coefficients divided by `D_UNIT` (the same feasible set)."""
    d = m.names.index("D")
    rows = [(lb, {v: c / D_UNIT if v == d else c for v, c in terms.items()}, ub) for lb, terms, ub in m.rows]
    return milp.Milp(list(m.names), list(m.lower), list(m.upper), list(m.integer), list(m.cost), rows,
                     m.contradiction)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _results.add_option(ap, "d_units_milp")
    a = ap.parse_args()
    run = _results.Run()
    t0 = time.perf_counter()
    models = capture()
    print(f"captured {len(models)} stage MILPs with D in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    names = ("bytes", "GiB", "GiB scaled")
    times: dict[str, list[float]] = {n: [] for n in names}
    worst, moved, differ = 0.0, 0, 0
    for i, (m, gap, options) in enumerate(models):
        ways = {"bytes": in_bytes(m), "GiB": m, "GiB scaled": m.row_scaled()}
        order = names[i % 3:] + names[:i % 3]
        got = {}
        for name in order:
            t, status, obj = _milp_capture.resolve(ways[name], gap, options)
            times[name].append(t)
            got[name] = (status, obj)
        (sb, ob), (sg, og) = got["bytes"], got["GiB"]
        differ += sb != sg
        if sb == sg == "optimal":
            rel = abs(og - ob) / max(abs(ob), 1e-12)
            worst = max(worst, rel / gap)  # in units of the model's own gap
            moved += rel > 1e-9
    sums = {n: sum(times[n]) for n in names}
    share = sums["GiB"] / sums["bytes"]
    t = Table(title=f"Lynx-HEU's interleaved offloading stage MILPs of the Llama-3.1-405B / 1,024 H100 search "
                    f"({len(models)} models with D, each solved three ways, rotating)")
    for c in ("D", "sum of HiGHS time", "slowest"):
        t.add_column(c, justify="left" if c == "D" else "right")
    for n, label in zip(names, ("in bytes (before 0271)", "in GiB (as built now)", "in GiB, row-scaled"),
                        strict=True):
        t.add_row(label, f"{sums[n]:.2f} s", f"{max(times[n]):.2f} s")
    Console().print(t)
    holds = (share <= SHARE_TARGET, worst <= 1.0)
    print(f"GiB / bytes: {share:.3f} (target <= {SHARE_TARGET}: {'holds' if holds[0] else 'does NOT hold'}); row-scaled"
          f" / as built: {sums['GiB scaled'] / sums['GiB']:.3f}; {moved} objectives moved, the largest by {worst:.2f} "
          f"of its model's gap (target <= 1: {'holds' if holds[1] else 'does NOT hold'}); {differ} models ended in "
          "another status")
    figures = [
        _results.Figure("stage MILPs with D solved", len(models), "models"),
        _results.Figure("D in bytes: sum of solve time", round(sums["bytes"], 2), "s"),
        _results.Figure("D in GiB: sum of solve time", round(sums["GiB"], 2), "s"),
        _results.Figure("D in GiB / D in bytes", round(share, 3), "x", f"<= {SHARE_TARGET}", holds[0]),
        _results.Figure("D in GiB, row-scaled / as built", round(sums["GiB scaled"] / sums["GiB"], 3), "x"),
        _results.Figure("D in bytes: slowest solve", round(max(times["bytes"]), 2), "s"),
        _results.Figure("D in GiB: slowest solve", round(max(times["GiB"]), 2), "s"),
        _results.Figure("objectives that moved (both optimal)", moved, "models"),
        _results.Figure("largest move, in its model's gap", round(worst, 3), "gap", "<= 1", holds[1]),
        _results.Figure("models ending in another status", differ, "models"),
    ]
    run.write(a.results, "d_units_milp", "measurement", "Lynx-HEU's interleaved offloading stage MILPs with D in bytes "
              "against D in GiB, the same models side by side", figures)
    if not all(holds):
        sys.exit(1)


if __name__ == "__main__":
    main()
