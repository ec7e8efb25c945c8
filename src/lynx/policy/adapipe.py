"""AdaPipe (Sun et al., ASPLOS'24) as a baseline: adaptive recomputation chosen by dynamic programming over
sub-layer units under each stage's 1F1B memory, plus a partitioning DP that minimizes the pipeline time.
All of its recomputation runs on demand, on the critical path (phase 5). No public code exists; what we
had to assume is listed in docs/opt-checkmate-adapipe.md.

Level 1 (per stage). A *unit* is an op whose stored state some backward reads (the op vocabulary's
``needed()``); a layer strategy saves a subset of units and recomputes the rest, with the ops they are
rebuilt from, right before the layer's backward. The stage's n layers may each use a different strategy.
With W the largest working set among the chosen strategies (what a layer drops in forward, or rebuilds
before its backward), the stage's peak (memory.stage_peak_bytes for on-demand policies) is

    static + extras + in_flight * sum_l retained(l) + W <= budget

so for every candidate W the problem is a knapsack: n layers, each picking one strategy of working set
<= W, minimizing the summed recomputation time under a budget on the summed retained bytes. The DP runs
over (layers, retained bytes in granules of `granule_bytes`, rounded up so that it is never optimistic).

Level 2 (across stages): `lynx.partition.adapipe`; the method that joins them: `lynx.methods.adapipe`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np

from lynx.cost.memory import layer_memory
from lynx.cost.pricing import ops_recompute_cost
from lynx.decisions import LayerPolicy, RecomputePolicy, SolveStats, StageContext
from lynx.errors import InfeasibleError
from lynx.graph import LayerGraph
from lynx.policy.rules import on_demand

GiB = float(1 << 30)
MAX_UNITS = 14
"""Units per layer enumerated exhaustively (2^14 strategies); beyond that only prefix/suffix sets."""


@dataclass(frozen=True, slots=True)
class Strategy:
    """One layer's choice: which units to save; its cost and memory per micro-batch."""

    policy: LayerPolicy
    retained: float
    """Bytes held from the layer's forward to its backward (input + saved units)."""
    work: float
    """Working set: max(what the forward drops, what is rebuilt before the backward)."""
    recompute_s: float


def layer_strategies(graph: LayerGraph) -> tuple[Strategy, ...]:
    """Every subset of units (Pareto-filtered on retained, working set and recompute time)."""
    units = [n for n in graph.names if n in graph.needed()]
    if len(units) <= MAX_UNITS:
        subsets = [frozenset(c) for k in range(len(units) + 1) for c in combinations(units, k)]
    else:  # save a prefix and a suffix of the layer (where the large attention tensors sit in between)
        subsets = [frozenset(units[:i] + units[j:]) for i in range(len(units) + 1) for j in range(i, len(units) + 1)]
    seen: dict[tuple[float, float, float], Strategy] = {}
    for keep in subsets:
        lp = on_demand(graph, keep)
        mem = layer_memory(graph, lp)
        t = ops_recompute_cost(graph, lp.recomputed())
        key = (mem.retained, max(mem.dropped, mem.on_demand), t)
        if key not in seen:
            seen[key] = Strategy(lp, *key)
    pts = list(seen.values())
    return tuple(s for s in pts if not any(_dominates(o, s) for o in pts))


def _dominates(a: Strategy, b: Strategy) -> bool:
    le = a.retained <= b.retained and a.work <= b.work and a.recompute_s <= b.recompute_s
    return le and (a.retained, a.work, a.recompute_s) != (b.retained, b.work, b.recompute_s)


@dataclass
class StageDP:
    """Level-1 tables shared by every stage of one problem: for each working-set cap W, ``best[k][b]`` is
    the least recomputation time of k layers whose retained bytes total at most b granules."""

    graph: LayerGraph
    max_layers: int
    capacity_bytes: float
    granule_bytes: float = float(8 << 20)
    strategies: tuple[Strategy, ...] = ()
    caps: tuple[float, ...] = ()
    best: list[np.ndarray] = field(default_factory=list)
    arg: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.strategies = layer_strategies(self.graph)
        self.caps = tuple(sorted({s.work for s in self.strategies}))
        g = int(math.ceil(self.capacity_bytes / self.granule_bytes)) + 1
        size = [int(math.ceil(s.retained / self.granule_bytes)) for s in self.strategies]
        for cap in self.caps:
            allowed = [i for i, s in enumerate(self.strategies) if s.work <= cap]
            best = np.full((self.max_layers + 1, g), np.inf)
            arg = np.full((self.max_layers + 1, g), -1, dtype=np.int32)
            best[0, :] = 0.0
            for k in range(1, self.max_layers + 1):
                for i in allowed:
                    r, t = size[i], self.strategies[i].recompute_s
                    if r >= g:
                        continue
                    cand = best[k - 1, : g - r] + t
                    better = cand < best[k, r:]
                    best[k, r:][better] = cand[better]
                    arg[k, r:][better] = i
            self.best.append(best)
            self.arg.append(arg)
        self._size = size

    def fixed_bytes(self, ctx: StageContext) -> float:
        return ctx.static_bytes + ctx.extra_transient_bytes + ctx.grad_workspace_bytes \
            + ctx.in_flight * ctx.extra_retained_bytes

    def solve(self, ctx: StageContext) -> tuple[float, tuple[Strategy, ...]] | None:
        """The least on-demand recomputation time per micro-batch of a stage that fits, and its layers."""
        n = ctx.num_layers
        if n > self.max_layers:
            raise ValueError(f"stage has {n} layers, tables built for {self.max_layers}")
        best: tuple[float, int, int] | None = None
        for c, cap in enumerate(self.caps):
            room = (ctx.budget_bytes - self.fixed_bytes(ctx) - cap) / ctx.in_flight
            if room < 0:
                continue
            b = min(int(room // self.granule_bytes), self.best[c].shape[1] - 1)
            t = float(self.best[c][n, b])
            if t < math.inf and (best is None or t < best[0] - 1e-15):
                best = (t, c, b)
        if best is None:
            return None
        t, c, b = best
        chosen: list[Strategy] = []
        for k in range(n, 0, -1):
            i = int(self.arg[c][k, b])
            chosen.append(self.strategies[i])
            b -= self._size[i]
        return t, tuple(chosen)

    def min_budget(self, ctx: StageContext) -> float:
        """The smallest budget any combination of strategies fits in (exact bytes)."""
        return min(self.fixed_bytes(ctx) + cap + ctx.in_flight * ctx.num_layers
                   * min(s.retained for s in self.strategies if s.work <= cap) for cap in self.caps)


def adapipe_stage_policy(ctx: StageContext, dp: StageDP) -> RecomputePolicy:
    t0 = time.perf_counter()
    res = dp.solve(ctx)
    if res is None:
        need = dp.min_budget(ctx)
        raise InfeasibleError(f"adapipe: stage {ctx.stage} ({ctx.num_layers} layers) needs {need / GiB:.2f} GiB, "
                              f"budget {ctx.budget_bytes / GiB:.2f} GiB", (need,))
    t, chosen = res
    layers = tuple(sorted((s.policy for s in chosen), key=lambda lp: len(lp.recompute)))
    stats = SolveStats(solver="dp", status="optimal", objective=t, solve_time_s=time.perf_counter() - t0,
                       message=f"{len(dp.strategies)} unit strategies, on-demand recompute {t * 1e3:.3f} ms/mb")
    return RecomputePolicy("adapipe", layers, stats=stats)
