"""Targets a benchmark states, checked against what it measured: a "holds" cell per figure and one summary
line, so a run says by itself which of its claims hold (docs/decisions/0047-benchmarks-check-their-targets.md).
Each check keeps the figure and the target it was held to, so `_results.py` can write them as data.

Kinds of target, each with the rule that decides it:
- `at_most(x, bound)` / `at_least(x, bound)`: a limit (latency < 2 s; lynx never slower than a baseline).
- `near(x, paper, tol)`: a figure the paper reports, reproduced within `tol` (relative, or absolute for
  shares given as fractions with `absolute=True`).
- `within(lo, hi, paper_lo, paper_hi, tol)`: a measured range inside the paper's range widened by `tol`.
A figure that could not be measured (no cell fits) is "n/a", never "yes".
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    holds: bool | None
    """None: nothing to compare (no measurement)."""
    value: float | str | None = None
    """The figure checked, when the check is about one number (or one range, as text)."""
    target: str = ""
    """The rule, as text ("<= 2", "0.77 ± 0.1")."""
    unit: str = ""


@dataclass
class Targets:
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, holds: bool | None, value: float | str | None = None, target: str = "") -> str:
        """Record a check and return its table cell."""
        self.checks.append(Check(name, holds, value, target))
        return cell(holds)

    def at_most(self, name: str, x: float | None, bound: float) -> str:
        return self.add(name, None if x is None else x <= bound, x, f"<= {bound:g}")

    def at_least(self, name: str, x: float | None, bound: float) -> str:
        return self.add(name, None if x is None else x >= bound, x, f">= {bound:g}")

    def near(self, name: str, x: float | None, paper: float, tol: float, absolute: bool = False) -> str:
        target = f"{paper:g} ± {tol:g}" if absolute else f"{paper:g} ± {tol:.0%}"
        if x is None:
            return self.add(name, None, None, target)
        return self.add(name, abs(x - paper) <= (tol if absolute else tol * abs(paper)), x, target)

    def within(self, name: str, lo: float | None, hi: float | None, paper_lo: float, paper_hi: float,
               tol: float = 0.05) -> str:
        target = f"range inside {paper_lo:g}-{paper_hi:g} widened by {tol:.0%}"
        if lo is None or hi is None:
            return self.add(name, None, None, target)
        return self.add(name, lo >= paper_lo * (1 - tol) and hi <= paper_hi * (1 + tol), f"{lo:.4g}-{hi:.4g}",
                        target)

    def row(self, checks: list[tuple[str, bool | None]]) -> str:
        """Several checks shown in one table cell: yes when all that could be decided hold."""
        for name, holds in checks:
            self.checks.append(Check(name, holds))
        decided = [h for _, h in checks if h is not None]
        return cell(None if not decided else all(decided))

    @staticmethod
    def is_near(x: float | None, paper: float, tol: float) -> bool | None:
        return None if x is None else abs(x - paper) <= tol * abs(paper)

    def summary(self) -> str:
        decided = [c for c in self.checks if c.holds is not None]
        failed = [c.name for c in decided if not c.holds]
        na = len(self.checks) - len(decided)
        line = f"targets: {len(decided) - len(failed)} of {len(decided)} hold"
        if na:
            line += f" ({na} not measurable in this run)"
        if failed:
            line += "; do not hold: " + "; ".join(failed)
        return line


def cell(holds: bool | None) -> str:
    return "n/a" if holds is None else ("[green]yes[/green]" if holds else "[red]no[/red]")
