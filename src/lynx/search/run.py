"""Branch and bound over the configuration space.

Every candidate gets its bounds first (cheap: static memory and the layer graph's plain step time). Those
over budget by the memory bound are refused; the rest are planned in ascending order of their time bound,
and once a candidate's bound exceeds the `top`-th best iteration time found (and, for stock Megatron-Core
candidates, the best stock time too) it and every later one are skipped: no plan of theirs could enter the
table. `exhaustive=True` plans everything (the test compares both)."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from lynx.errors import LynxError
from lynx.problem import PlanOptions
from lynx.search.bounds import memory_bound_reason, time_bound_s
from lynx.search.evaluate import LYNX_SEARCHED, Outcome, Shared, plan_candidate
from lynx.search.space import Candidate, Rejected, Space, candidates

Progress = Callable[[int, int, str], None]
"""(done, total, what): called as candidates are decided."""


@dataclass(frozen=True, slots=True)
class SearchResult:
    space: Space
    outcomes: tuple[Outcome, ...]
    """Every candidate, planned ones fastest first, then the rest."""
    rejected: tuple[Rejected, ...]
    seconds: float
    stage_problems: int
    """Distinct Lynx-HEU stage problems solved (the rest were cache hits)."""
    stage_hits: int

    @property
    def ranked(self) -> tuple[Outcome, ...]:
        return tuple(o for o in self.outcomes if o.fits)

    @property
    def best(self) -> Outcome | None:
        return next(iter(self.ranked), None)

    @property
    def best_stock(self) -> Outcome | None:
        return next((o for o in self.ranked if o.candidate.stock), None)

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def considered(self) -> int:
        return len(self.outcomes)

    @property
    def pruned(self) -> int:
        return self.count("pruned (time bound)") + self.count("over budget (bound)")

    @property
    def simulated(self) -> int:
        """Planned candidates the event simulator judged (the rest were refused on their policy's held
        activations before simulation, or had no policy that fits)."""
        return sum(not math.isnan(o.iteration_s) for o in self.outcomes)

    @property
    def planned(self) -> int:
        """Candidates that went through the planner (fitting or not)."""
        return self.count("planned") + self.count("does not fit")


class _Incumbents:
    """The `top` best iteration times overall and the best stock time: what a bound must beat."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.heap: list[float] = []  # negated: the worst of the best `top` on top
        self.stock = math.inf

    def add(self, o: Outcome) -> None:
        if not o.fits:
            return
        heapq.heappush(self.heap, -o.iteration_s)
        if len(self.heap) > self.top:
            heapq.heappop(self.heap)
        if o.candidate.stock:
            self.stock = min(self.stock, o.iteration_s)

    def prunes(self, cand: Candidate, bound: float) -> bool:
        kth = -self.heap[0] if len(self.heap) >= self.top else math.inf
        return bound > kth and (not cand.stock or bound > self.stock)


def _bounds(shared: Shared, cands: list[Candidate]) -> tuple[list[tuple[float, int]], list[Outcome | None]]:
    """Time bound per candidate (ascending order for planning), and the outcomes refused by memory."""
    order: list[tuple[float, int]] = []
    refused: list[Outcome | None] = [None] * len(cands)
    memo: dict[tuple[object, ...], str] = {}
    for i, c in enumerate(cands):
        try:
            problem = shared.problem(c.layout, even=c.stock)
        except LynxError as e:
            refused[i] = Outcome(c, "invalid", math.nan, str(e).splitlines()[0])
            continue
        bound = time_bound_s(problem)
        key = (c.layout, c.stock, c.method in ("uniform", "block"))
        if key not in memo:
            memo[key] = memory_bound_reason(problem, c.method)
        if memo[key]:
            refused[i] = Outcome(c, "over budget (bound)", bound, memo[key])
        else:
            order.append((bound, i))
    order.sort()
    return order, refused


def _refine_finalists(shared: Shared, outcomes: list[Outcome], n: int) -> list[Outcome]:
    """lynx's simulator-judged partition refinement (up to 40 simulations each) for the `n` fastest lynx
    candidates only: it moves a plan by a fraction of a percent, and screening every candidate with it would
    multiply the search's time by ten (docs/decisions/0069-configuration-search.md)."""
    lynx = sorted((o for o in outcomes if o.fits and o.candidate.method in LYNX_SEARCHED),
                  key=lambda o: o.iteration_s)
    better = {id(o): plan_candidate(shared, o.candidate, o.bound_s, refine=True) for o in lynx[:n]}
    return [better.get(id(o), o) for o in outcomes]


def search(space: Space, base: PlanOptions | None = None, top: int = 5, exhaustive: bool = False,
           progress: Progress | None = None) -> SearchResult:
    """Plan the space's candidates, pruning by bounds unless `exhaustive`."""
    t0 = time.perf_counter()
    shared = Shared(space, base or PlanOptions())
    cands, rejected = candidates(space)
    order, outcomes = _bounds(shared, cands)  # the bounds hold for refined plans too
    done = len(cands) - len(order)
    if progress is not None:
        progress(done, len(cands), "bounds")
    inc = _Incumbents(top)
    for bound, i in order:
        c = cands[i]
        if not exhaustive and inc.prunes(c, bound):
            outcomes[i] = Outcome(c, "pruned (time bound)", bound,
                                  f"time bound {bound:.3f} s exceeds the {top} best found")
        else:
            outcomes[i] = plan_candidate(shared, c, bound)
            inc.add(outcomes[i])  # type: ignore[arg-type]
        done += 1
        if progress is not None:
            progress(done, len(cands), f"{c.layout.label()} {c.method}")
    final = _refine_finalists(shared, [o for o in outcomes if o is not None], 2 * top)
    final.sort(key=lambda o: (not o.fits, o.iteration_s if o.fits else math.inf, o.candidate.layout,
                              o.candidate.method))
    solves = sum(h.solves for h in shared.heu.values())
    hits = sum(h.hits for h in shared.heu.values())
    return SearchResult(space, tuple(final), tuple(rejected), time.perf_counter() - t0, solves, hits)
