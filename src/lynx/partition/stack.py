"""Recomputation-aware partitioning of a stack of unequal layers (layer kinds, `lynx.stack`; docs/decisions/0221).

With layers of several kinds a stage's cost depends on which layers it holds, not only how many: DeepSeek-V3's
three dense layers are cheaper and lighter than its MoE layers. The oracle is ``cost(stage, first, n)`` (the
stage's seconds per micro-batch holding layers first .. first + n - 1; infinite when no policy fits) and the
search is the exact min-max over contiguous splits by dynamic programming from the last stage down:

    best(s, i) = min over n of max(cost(s, i, n), best(s + 1, i + n)),   best(p, L) = 0,

ties broken towards the smaller sum of stage costs. Each stage's layer count is bounded by `max_layers`
(default twice the even share plus one: a stage with more never minimizes the maximum when every stage must hold
a layer and costs grow with layers), which keeps the oracle calls at O(p x L x max_layers), most of them cache
hits (the cost depends on the stage and the kinds of its layers).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lynx.partition.base import Partition
from lynx.partition.lynx import PartitionSearch

StackCost = Callable[[int, int, int], float]
"""(stage, first layer, layers) -> seconds per micro-batch (inf: no policy fits)."""


def stack_partition(num_layers: int, num_stages: int, cost: StackCost, max_layers: int | None = None,
                    lower: StackCost | None = None) -> PartitionSearch:
    """`lower(stage, first, n)`: a lower bound on `cost` (the layers' plain step times and the stage's edge: what a
    stage costs before its recomputation). With it, each (stage, first layer) tries its layer counts in the order of
    that bound and stops at the first whose bound cannot beat the best found; the oracle is not asked for the rest.
    The answer is the same as without it (ties too: the smaller layer count, as the plain scan keeps)."""
    L, p = num_layers, num_stages
    cap = max_layers or 2 * math.ceil(L / p) + 1
    memo: dict[tuple[int, int, int], float] = {}

    def c(s: int, i: int, n: int) -> float:
        k = (s, i, n)
        if k not in memo:
            memo[k] = cost(s, i, n)
        return memo[k]

    inf = (math.inf, math.inf)
    # best[s][i]: (max cost, sum of costs) of stages s.. on layers i..; choice[s][i]: layers of stage s
    best: list[dict[int, tuple[float, float]]] = [dict() for _ in range(p + 1)]
    choice: list[dict[int, int]] = [dict() for _ in range(p)]
    best[p][L] = (0.0, 0.0)
    for s in range(p - 1, -1, -1):
        rest = p - s - 1
        for i in range(s, L - rest):  # stage s starts at i: every stage before it holds a layer at least
            cur, arg = inf, 0
            tries = []
            for n in range(1, min(cap, L - rest - i) + 1):
                tail = best[s + 1].get(i + n, inf)
                if tail[0] == math.inf:
                    continue
                lo = lower(s, i, n) if lower is not None else -math.inf
                tries.append(((max(lo, tail[0]), lo + tail[1]), n, tail))
            if lower is not None:
                tries.sort()
            for bound, n, tail in tries:
                if lower is not None:
                    if bound > cur:
                        break  # sorted: no later count's bound beats it either (nor its cost, at least its bound)
                    if bound == cur and n > arg:
                        continue
                here = c(s, i, n)
                cand = (max(here, tail[0]), here + tail[1])
                if cand < cur or (cand == cur and n < arg):
                    cur, arg = cand, n
            best[s][i] = cur
            choice[s][i] = arg
    top = best[0].get(0, inf)
    if top[0] == math.inf:
        return PartitionSearch(None, None, math.inf, math.inf, len(memo))
    counts, i = [], 0
    for s in range(p):
        n = choice[s][i]
        counts.append(n)
        i += n
    return PartitionSearch(None, Partition(tuple(counts), method="lynx-exact"), math.inf, top[0], len(memo))
