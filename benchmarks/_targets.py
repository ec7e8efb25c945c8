"""Targets a benchmark states, checked against what it measured: a "holds" cell per figure and one summary
line, so a run says by itself which of its claims hold (docs/decisions.md, "Benchmarks check their targets").

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


@dataclass
class Targets:
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, holds: bool | None) -> str:
        """Record a check and return its table cell."""
        self.checks.append(Check(name, holds))
        return cell(holds)

    def at_most(self, name: str, x: float | None, bound: float) -> str:
        return self.add(name, None if x is None else x <= bound)

    def at_least(self, name: str, x: float | None, bound: float) -> str:
        return self.add(name, None if x is None else x >= bound)

    def near(self, name: str, x: float | None, paper: float, tol: float, absolute: bool = False) -> str:
        if x is None:
            return self.add(name, None)
        return self.add(name, abs(x - paper) <= (tol if absolute else tol * abs(paper)))

    def within(self, name: str, lo: float | None, hi: float | None, paper_lo: float, paper_hi: float,
               tol: float = 0.05) -> str:
        if lo is None or hi is None:
            return self.add(name, None)
        return self.add(name, lo >= paper_lo * (1 - tol) and hi <= paper_hi * (1 + tol))

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
