"""The MILPs a `lynx` command solves, kept for re-solving side by side (benchmarks/offload_milp.py,
benchmarks/d_units_milp.py)."""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Sequence
from typing import Any

import lynx.milp as milp
from lynx.cli import main as main_cli

Kept = tuple[milp.Milp, float, milp.HighsOptions]
"""A model as the command solved it: the model, its relative gap and its HiGHS options."""


def capture(command: Sequence[str], keep: Callable[[milp.Milp, float], bool]) -> list[Kept]:
    """Every model `lynx <command>` solves (in this process, its output discarded) that `keep(model, gap)` accepts."""
    kept: list[Kept] = []
    solve = milp.Milp.solve

    def logged(self: milp.Milp, time_limit_s: float = 30.0, mip_gap: float = 1e-6, *args: Any,
               **kw: Any) -> milp.MilpSolution:
        if keep(self, mip_gap):
            kept.append((self, mip_gap, tuple(kw.get("highs_options", ()))))
        return solve(self, time_limit_s, mip_gap, *args, **kw)

    milp.Milp.solve = logged  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main_cli(list(command))
    finally:
        milp.Milp.solve = solve  # type: ignore[method-assign]
    return kept


def resolve(m: milp.Milp, gap: float, options: milp.HighsOptions) -> tuple[float, str, float]:
    """(seconds, status, objective) of one solve at `gap` and the search's 10 s limit."""
    t0 = time.perf_counter()
    sol = m.solve(10.0, gap, highs_options=options)
    return time.perf_counter() - t0, sol.status, sol.objective
