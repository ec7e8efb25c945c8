"""HiGHS time of Lynx-HEU's stage MILPs as built and row-scaled (`Milp.row_scaled`, decision 0271), on the same
models side by side.

    python benchmarks/scaled_milp.py --results benchmarks/results/scaled_milp.json

It runs `lynx plan --model llama3.1-405b --hardware h100-80g-nvlink --gpus 1024 --global-batch 2048 --seq-len 8192
--jobs 1` (`benchmarks/config_search.py`'s 405B case) in this process and keeps every stage MILP the search solves
(`policy.heu.solve_stage` scales each before it solves it; the model as built is the one kept), then solves each
again as built and scaled, with the search's gap and HiGHS options, alternating which goes first model by model so
the machine's drift falls on both alike. Printed: the models, each way's sum and slowest solve, and how far the
objectives move (each solve stops within its model's relative gap, 1e-6 for lynx's models and 1e-3 for the
offloading ones, so the two ways may stop at different answers inside it). Targets: scaled takes at most 80% of the
as-built sum, and no objective moves by more than its gap. HiGHS runs one thread; the search's own time is
config_search.json's figure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from typing import Any

import _results
from rich.console import Console
from rich.table import Table

import lynx.milp as milp
from lynx.cli import main as main_cli

SHARE_TARGET = 0.8
COMMAND = ["plan", "--model", "llama3.1-405b", "--hardware", "h100-80g-nvlink", "--gpus", "1024", "--global-batch",
           "2048", "--seq-len", "8192", "--precision", "megatron-bf16", "--json", "--jobs", "1"]

Kept = tuple[milp.Milp, float, milp.HighsOptions]


def capture() -> list[Kept]:
    """Each stage MILP the search solves, as built, with its gap and HiGHS options."""
    built: list[milp.Milp] = []
    kept: list[Kept] = []
    scale, solve = milp.Milp.row_scaled, milp.Milp.solve

    def scaled(self: milp.Milp) -> milp.Milp:
        out = scale(self)
        if any(self.integer):
            built.append(self)
            out.names = [*out.names]  # a distinct object to recognise in `logged`
            setattr(out, "_built", len(built) - 1)  # noqa: B010
        return out

    def logged(self: milp.Milp, time_limit_s: float = 30.0, mip_gap: float = 1e-6, *args: Any,
               **kw: Any) -> milp.MilpSolution:
        i = getattr(self, "_built", None)
        if i is not None:
            kept.append((built[i], mip_gap, tuple(kw.get("highs_options", ()))))
        return solve(self, time_limit_s, mip_gap, *args, **kw)

    milp.Milp.row_scaled = scaled  # type: ignore[method-assign]
    milp.Milp.solve = logged  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main_cli(COMMAND)
    finally:
        milp.Milp.row_scaled, milp.Milp.solve = scale, solve  # type: ignore[method-assign]
    return kept


def resolve(m: milp.Milp, gap: float, options: milp.HighsOptions) -> tuple[float, str, float]:
    t0 = time.perf_counter()
    sol = m.solve(10.0, gap, highs_options=options)
    return time.perf_counter() - t0, sol.status, sol.objective


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _results.add_option(ap, "scaled_milp")
    a = ap.parse_args()
    run = _results.Run()
    t0 = time.perf_counter()
    models = capture()
    print(f"captured {len(models)} stage MILPs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    times: dict[str, list[float]] = {"built": [], "scaled": []}
    worst, moved, differ = 0.0, 0, 0
    for i, (m, gap, options) in enumerate(models):
        ways = {"built": m, "scaled": m.row_scaled()}
        got = {}
        for name in (ways if i % 2 == 0 else reversed(list(ways))):
            t, status, obj = resolve(ways[name], gap, options)
            times[name].append(t)
            got[name] = (status, obj)
        (sb, ob), (ss, os_) = got["built"], got["scaled"]
        differ += sb != ss
        if sb == ss == "optimal":
            rel = abs(os_ - ob) / max(abs(ob), 1e-12)
            worst = max(worst, rel / gap)  # in units of the model's own gap
            moved += rel > 1e-9
    built, scaled = sum(times["built"]), sum(times["scaled"])
    share = scaled / built
    t = Table(title=f"Lynx-HEU's stage MILPs of the Llama-3.1-405B / 1,024 H100 search ({len(models)} models, each "
                    "solved as built and row-scaled, alternating)")
    for c in ("way", "sum of HiGHS time", "slowest"):
        t.add_column(c, justify="left" if c == "way" else "right")
    t.add_row("as built", f"{built:.2f} s", f"{max(times['built']):.2f} s")
    t.add_row("row-scaled (the search's)", f"{scaled:.2f} s", f"{max(times['scaled']):.2f} s")
    Console().print(t)
    holds = (share <= SHARE_TARGET, worst <= 1.0)
    print(f"row-scaled / as built: {share:.3f} (target <= {SHARE_TARGET}: {'holds' if holds[0] else 'does NOT hold'});"
          f" {moved} objectives moved, the largest by {worst:.2f} of its model's gap (target <= 1: "
          f"{'holds' if holds[1] else 'does NOT hold'}); {differ} models ended in another status")
    figures = [
        _results.Figure("stage MILPs solved", len(models), "models"),
        _results.Figure("as built: sum of solve time", round(built, 2), "s"),
        _results.Figure("row-scaled: sum of solve time", round(scaled, 2), "s"),
        _results.Figure("row-scaled / as built", round(share, 3), "x", f"<= {SHARE_TARGET}", holds[0]),
        _results.Figure("as built: slowest solve", round(max(times["built"]), 2), "s"),
        _results.Figure("row-scaled: slowest solve", round(max(times["scaled"]), 2), "s"),
        _results.Figure("objectives that moved (both optimal)", moved, "models"),
        _results.Figure("largest move, in its model's gap", round(worst, 3), "gap", "<= 1", holds[1]),
        _results.Figure("models ending in another status", differ, "models"),
    ]
    run.write(a.results, "scaled_milp", "measurement", "Lynx-HEU's stage MILPs as built against row-scaled, the same "
              "models side by side", figures)
    if not all(holds):
        sys.exit(1)


if __name__ == "__main__":
    main()
