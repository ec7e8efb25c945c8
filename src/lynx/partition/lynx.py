"""Recomputation-aware partitioning (paper sec. 5): layer counts per stage chosen knowing that the
recomputation policy, and so each stage's time, depends on how many layers (and how much memory) it has.

Both searches work on a stage-cost oracle ``cost(stage, n_layers) -> seconds per micro-batch`` (infinite
when no policy fits), which the caller builds from HEU (cached per distinct stage problem):

* `greedy_partition` - the paper's loop, verbatim: from an even split, move one layer from the slowest
  stage to the fastest; keep the move if it is valid (no OOM) and shortens the longest stage; stop when
  nothing changes.
* `exact_partition` - the exact min-max over layer counts. Stage costs are separable and non-decreasing
  in the stage's layer count (more layers: more compute, and a smaller feasible policy set), so an
  allocation ``n`` is optimal iff ``max_s cost(s, n_s) <= min_s cost(s, n_s + 1)``: otherwise moving one
  layer from the argmax to the argmin lowers (or keeps, with fewer stages at) the maximum. Starting from
  any split, exchanging one layer at a time reaches that certificate; it evaluates a few costs per move
  instead of the C(L-1, p-1) compositions a blind enumeration would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lynx.partition.base import Partition, even_partition

StageCost = Callable[[int, int], float]
StageCosts = Callable[[Sequence[tuple[int, int]]], list[float]]
"""The oracle over several (stage, layers) at once: their costs in order (which it may evaluate side by side)."""


@dataclass
class CostTable:
    """Memoizes the oracle per (stage, layers) and counts distinct evaluations. `many`: the oracle over several
    keys at once, which `prefetch` hands the keys not yet known (the values are `fn`'s)."""

    fn: StageCost
    values: dict[tuple[int, int], float] = field(default_factory=dict)
    many: StageCosts | None = None

    def __call__(self, stage: int, n: int) -> float:
        k = (stage, n)
        if k not in self.values:
            self.values[k] = self.fn(stage, n)
        return self.values[k]

    def prefetch(self, keys: Sequence[tuple[int, int]]) -> None:
        """Evaluate the keys not yet known, through `many` where there is one and more than one is new (the
        searches call it only with keys they evaluate next anyway: the count stays theirs)."""
        new = list(dict.fromkeys(k for k in keys if k not in self.values))
        if self.many is not None and len(new) > 1:
            self.values.update(zip(new, self.many(new), strict=True))


def greedy_partition(start: tuple[int, ...], cost: StageCost, max_iters: int = 10_000) -> tuple[int, ...]:
    """The paper's greedy loop (sec. 5, steps 1-5)."""
    cur = list(start)
    if isinstance(cost, CostTable):
        cost.prefetch(list(enumerate(cur)))
    times = [cost(s, n) for s, n in enumerate(cur)]
    for _ in range(max_iters):
        slow = max(range(len(cur)), key=lambda s: times[s])
        fast = min(range(len(cur)), key=lambda s: times[s])
        if slow == fast or cur[slow] <= 1:
            break
        new = list(cur)
        new[slow] -= 1
        new[fast] += 1
        new_times = list(times)
        if isinstance(cost, CostTable):
            cost.prefetch([(slow, new[slow]), (fast, new[fast])])
        new_times[slow], new_times[fast] = cost(slow, new[slow]), cost(fast, new[fast])
        valid = all(t < float("inf") for t in new_times)
        if not (valid and max(new_times) < max(times)):
            break
        cur, times = new, new_times
    return tuple(cur)


def exact_partition(start: tuple[int, ...], cost: StageCost, lower: StageCost | None = None) -> tuple[int, ...] | None:
    """The min-max optimal layer counts (see the module docstring); None when no split is feasible.
    `lower(stage, n)`: a lower bound of `cost(stage, n)`; with it, a stage's cost with one more layer is only
    evaluated when it could be the smallest one below the current maximum (the same moves, fewer evaluations)."""
    cur = list(start)
    p = len(cur)
    # Potential (max, #stages at max, their layers) decreases lexicographically on every move: terminates.
    for _ in range(sum(cur) * p + p):
        vals = [cost(s, cur[s]) for s in range(p)]
        top = max(vals)
        a = max((s for s in range(p) if vals[s] == top), key=lambda s: cur[s])
        if cur[a] <= 1:
            break  # every split gives stage a >= 1 layer, so max >= cost(a, 1): optimal
        b = _cheapest_next(cur, a, top, cost, lower)
        if b is None:
            break  # certificate: max_s cost(s, n_s) <= min_s cost(s, n_s + 1)
        cur[a] -= 1
        cur[b] += 1
    if max(cost(s, cur[s]) for s in range(p)) == float("inf"):
        return None
    return tuple(cur)


def _cheapest_next(cur: list[int], a: int, top: float, cost: StageCost, lower: StageCost | None) -> int | None:
    """The first stage s != a minimizing cost(s, cur[s] + 1), if that minimum is below `top`; else None.
    With `lower`, stages are visited by their bound and skipped when the bound shows they cannot be the
    first minimum below `top`; the answer is the one the full scan gives."""
    p = len(cur)
    if lower is None:
        nexts = [cost(s, cur[s] + 1) if s != a else float("inf") for s in range(p)]
        b = min(range(p), key=lambda s: nexts[s])
        return b if nexts[b] < top else None
    bounds = sorted((lower(s, cur[s] + 1), s) for s in range(p) if s != a)
    best, arg = float("inf"), -1
    for lb, s in bounds:
        if not lb < top or lb > best:
            break  # sorted by bound: no later stage can be below top and at most the best
        if lb == best and s > arg:
            continue  # at best it ties, and the earlier stage wins ties
        c = cost(s, cur[s] + 1)
        if c < best or (c == best and s < arg):
            best, arg = c, s
    return arg if best < top else None


def minmax_cost(counts: tuple[int, ...], cost: StageCost) -> float:
    return max(cost(s, n) for s, n in enumerate(counts))


@dataclass(frozen=True, slots=True)
class PartitionSearch:
    """Both searches' results on one oracle."""

    greedy: Partition | None
    exact: Partition | None
    greedy_cost: float
    exact_cost: float
    evaluations: int


def search_partitions(num_layers: int, num_stages: int, cost: StageCost,
                      start: tuple[int, ...] | None = None, lower: StageCost | None = None,
                      many: StageCosts | None = None) -> PartitionSearch:
    """Run the paper's greedy loop from an even split (or `start`), then the exact search from the
    greedy's result (a warm start; the result does not depend on it). `lower`: a lower bound of `cost`
    that spares the exact search evaluations (`exact_partition`). `many`: `cost` over several keys at once
    (`CostTable.many`), for the evaluations the greedy loop makes together."""
    table = CostTable(cost, many=many)
    init = start or even_partition(num_layers, num_stages).layers_per_stage
    g = greedy_partition(init, table)
    g_cost = minmax_cost(g, table)
    e = exact_partition(g, table, lower)
    e_cost = minmax_cost(e, table) if e is not None else float("inf")
    return PartitionSearch(
        greedy=Partition(g, method="lynx-greedy") if g_cost < float("inf") else None,
        exact=Partition(e, method="lynx-exact") if e is not None else None,
        greedy_cost=g_cost, exact_cost=e_cost, evaluations=len(table.values),
    )
