"""AdaPipe's stage partitioning (Sun et al., ASPLOS'24, sec. 5): a dynamic program over contiguous layer
ranges that minimizes the 1F1B pipeline time, given each stage's time *with its own adaptive
recomputation* (the per-stage DP in `lynx.policy.adapipe`), so that memory-tight stages can take fewer
layers and the others more.

Pipeline time of non-interleaved 1F1B with m micro-batches and per-micro-batch stage times T_s (forward +
backward + recomputation):  sum_s T_s + (m - 1) * max_s T_s  (the first micro-batch's trip through the
pipeline plus m - 1 rounds at the bottleneck's pace). It is minimized exactly: for each candidate
bottleneck value B, a DP finds the smallest sum of stage times with every T_s <= B, and only the B that can
still win (B <= B* + (sum at B* - smallest possible sum) / (m - 1)) are tried.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lynx.partition.base import Partition

StageTime = Callable[[int, int], float]
"""(stage, number of layers) -> seconds per micro-batch, or math.inf when no recomputation fits."""


def pipeline_time(times: list[float], num_microbatches: int) -> float:
    return sum(times) + (num_microbatches - 1) * max(times)


def _min_sum(num_layers: int, pp: int, T: list[list[float]], bound: float) -> tuple[float, list[int]]:
    """Smallest sum of stage times with every stage time <= bound; the counts per stage."""
    inf = math.inf
    best = [[inf] * (num_layers + 1) for _ in range(pp + 1)]
    arg = [[0] * (num_layers + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for s in range(1, pp + 1):
        for k in range(s, num_layers - (pp - s) + 1):
            for n in range(1, k - (s - 1) + 1):
                t = T[s - 1][n]
                prev = best[s - 1][k - n]
                if t > bound or prev == inf:
                    continue
                if prev + t < best[s][k]:
                    best[s][k], arg[s][k] = prev + t, n
    if best[pp][num_layers] == inf:
        return inf, []
    counts, k = [], num_layers
    for s in range(pp, 0, -1):
        counts.append(arg[s][k])
        k -= arg[s][k]
    return best[pp][num_layers], counts[::-1]


def _min_max(num_layers: int, pp: int, T: list[list[float]]) -> float:
    """The smallest achievable bottleneck (binary search over the distinct stage times)."""
    vals = sorted({t for row in T for t in row[1:] if t < math.inf})
    lo, hi = 0, len(vals) - 1
    if not vals or _min_sum(num_layers, pp, T, vals[hi])[0] == math.inf:
        return math.inf
    while lo < hi:
        mid = (lo + hi) // 2
        if _min_sum(num_layers, pp, T, vals[mid])[0] < math.inf:
            hi = mid
        else:
            lo = mid + 1
    return vals[lo]


def adapipe_partition(num_layers: int, pp: int, num_microbatches: int, stage_time: StageTime) -> Partition | None:
    """The partition minimizing the 1F1B pipeline time; None when no partition lets every stage fit."""
    T = [[math.inf] + [stage_time(s, n) for n in range(1, num_layers - pp + 2)] + [math.inf] * (pp - 1)
         for s in range(pp)]
    b_star = _min_max(num_layers, pp, T)
    if b_star == math.inf:
        return None
    sum_star, counts = _min_sum(num_layers, pp, T, b_star)
    sum_lb, _ = _min_sum(num_layers, pp, T, math.inf)
    best = (pipeline_time([T[s][c] for s, c in enumerate(counts)], num_microbatches), counts)
    slack = (sum_star - sum_lb) / max(1, num_microbatches - 1)
    for b in sorted({t for row in T for t in row if b_star < t <= b_star + slack + 1e-15}):
        total, cs = _min_sum(num_layers, pp, T, b)
        if cs:
            cand = (pipeline_time([T[s][c] for s, c in enumerate(cs)], num_microbatches), cs)
            if cand[0] < best[0] - 1e-15:
                best = cand
    return Partition(tuple(best[1]), method="adapipe")
