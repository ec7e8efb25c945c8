"""Lower bounds that let the search skip a candidate without planning it, and never lose the optimum.

* Memory: every stage holds its parameters, gradients and optimizer state (`stage_context().static_bytes`)
  and, for each micro-batch in flight at its peak, at least its layers' inputs (every policy but Megatron's
  uniform/block chunks checkpoints each layer's input; those keep at least the stage's input). If no split
  of the layers over the stages keeps every stage within budget, no method and no partition fits.
  Offloading (`lynx-offload`, `mc-offload`) leaves the bound a lower bound as it is: the bytes it may move to
  the host are the offloadable ones of each in-flight micro-batch, and the bound counts none of those (a layer's
  input is never an offload candidate: HEU offloads op outputs only, and `mc-offload` does not model
  `attn_norm`, docs/offload.md), so the maximum offloadable bytes removed from it are zero whatever the host
  memory. tests/unit/test_search.py plans the refused offloading candidates anyway: none fits.
* Time: a 1F1B pipeline cannot finish before some stage k has received micro-batch 0 (the forwards of the
  stages before it), run all its micro-batches, and sent the last backward down (the backwards of the stages
  before it). With each layer costing at least its plain forward + backward `u` (`LayerGraph.step_time`,
  what the simulator charges before any recomputation or transfer), the iteration takes at least
  u * min over splits of max_k (layers before k + micro-batches * layers on k). The embedding (first stage)
  and the LM head + loss (last stage) are added as the simulator charges them: per micro-batch on their own
  stage, and the embedding's forward and backward once on every later stage's chain. Interleaved schedules
  get the busiest-rank bound: micro-batches x (u x layers + embedding + head) / PP.

Both bounds read the problem the planner would plan (its graph, its static-memory recipe), so a change of
the cost model moves them with it; tests/unit/test_search.py checks them against planned candidates.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lynx.cost.edges import stage_edge_times
from lynx.cost.memory import static_bytes
from lynx.problem import PlanProblem
from lynx.stack import kinds_present

SAFETY = 1.0 - 1e-9
"""The time bound multiplies by this: summing per-action times in another order may round differently."""
CHUNKED_METHODS = frozenset({"uniform", "block"})
"""Methods whose layers may drop their input checkpoint (Megatron's recompute chunks)."""


def _largest_fitting(fits: Callable[[int], bool], hi: int) -> int:
    """The largest n in [0, hi] with fits(n), for a monotone `fits` (0 when even one layer does not fit)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _stage_bytes(problem: PlanProblem, stage: int, n: int, per_layer_inputs: bool) -> float:
    """`stage_context(stage, n).static_bytes` plus the layer inputs in flight, without building the context
    (the same `static_bytes` call and the schedule's in-flight count)."""
    o = problem.options
    # several layer kinds: the lightest kind's stage (a bound whatever layers the stage gets)
    static = min(static_bytes(problem.model, problem.parallel, stage, n, o.bytes_per_param, o.precision,
                              o.distributed_optimizer, (k,) * n if problem.heterogeneous else None)
                 for k in (kinds_present(problem.model) if problem.heterogeneous else ("dense",)))
    if o.vpp > 1:  # any split of the n layers over the chunks: static memory does not depend on it
        return static  # in-flight counts differ per chunk: the static part alone is the bound
    in_flight = max(c.in_flight for c in problem.facts.chunks[stage])
    return static + in_flight * problem.graph.input_bytes * (n if per_layer_inputs else 1)


def memory_bound_reason(problem: PlanProblem, method: str) -> str:
    """Why no partition of this layout can fit the budget with `method` ('' when one might)."""
    pp, layers, vpp = problem.parallel.pp, problem.model.num_layers, problem.options.vpp
    budget = problem.budget_bytes
    per_layer = method not in CHUNKED_METHODS
    cap = layers - pp + 1  # every other stage needs at least one layer
    lo = vpp if vpp > 1 else 1  # layers a stage needs at least (one per chunk)
    even = -(-layers // pp)
    if even >= lo and all(_stage_bytes(problem, s, even, per_layer) <= budget for s in range(pp)):
        return ""  # the balanced split fits the bound already: no need to look further
    room = 0
    for s in range(pp):
        def fits(k: int, s: int = s) -> bool:
            return k < lo or _stage_bytes(problem, s, k, per_layer) <= budget

        n = _largest_fitting(fits, cap)
        if n < lo:
            need = _stage_bytes(problem, s, lo, per_layer)
            return (f"stage {s} needs at least {need / 2**30:.1f} GiB with {lo} layer(s) (static memory"
                    f"{' + layer inputs in flight' if vpp == 1 else ''}); budget {budget / 2**30:.1f} GiB")
        room += n
    if room < layers:
        return (f"at most {room} of {layers} layers fit over {pp} stages (static memory"
                f"{' + layer inputs in flight' if vpp == 1 else ''}; budget {budget / 2**30:.1f} GiB)")
    return ""


def _min_max_prefix(layers: int, stages: int, nmb: int) -> int:
    """min over splits (n_k >= 1, sum = layers) of max_k (sum_{s<k} n_s + nmb * n_k), by bisection on the
    answer: for a target M, give each stage in order the most layers M allows and check they reach `layers`."""

    def reachable(m: int) -> bool:
        prefix = 0
        for k in range(stages):
            left = stages - k - 1
            n = min((m - prefix) // nmb, layers - prefix - left)
            if n < 1:
                return False
            prefix += n
        return prefix == layers

    lo, hi = 1, layers * nmb + layers
    while lo < hi:
        mid = (lo + hi) // 2
        if reachable(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _min_max_with_edges(layers: int, nmb: int, u: float, const: list[float]) -> float:
    """A lower bound on min over splits of max_k (const_k + u * sum_{s<k} n_s + nmb * u * n_k): bisection on
    the answer M with the same greedy fill (giving an earlier stage more never hurts a later one, since a layer
    costs a later stage u of its prefix but nmb * u if it ran there); returns the largest M found unreachable
    (below the true minimum)."""
    stages = len(const)

    def reachable(m: float) -> bool:
        prefix = 0
        for k in range(stages):
            left = stages - k - 1
            room = (m - const[k] - u * prefix) / (nmb * u)
            n = min(math.floor(room), layers - prefix - left)
            if n < 1:
                return False
            prefix += n
        return prefix == layers

    lo, hi = 0.0, max(const) + u * (layers + nmb * layers)
    if not reachable(hi):  # cannot happen: every stage fits all layers at hi
        return 0.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if mid <= lo or mid >= hi:
            break
        if reachable(mid):
            hi = mid
        else:
            lo = mid
    return lo


def time_bound_s(problem: PlanProblem) -> float:
    """A lower bound on the iteration time of any plan of this layout (any method, any partition)."""
    par, layers = problem.parallel, problem.model.num_layers
    # several layer kinds: the cheapest kind's layer time (a lower bound for any layer)
    u = min(g.step_time(problem.options.subtract_wgrad) for g in (dict(problem.kind_graphs).values()
                                                                   if problem.heterogeneous else (problem.graph,)))
    nmb, pp = par.num_microbatches, par.pp
    emb = head = 0.0
    if problem.options.include_edges:  # what the simulator adds to the first and last virtual stage
        et = stage_edge_times(problem.model, problem.hardware, par, problem.graph)
        emb, head = et.embedding_fwd + et.embedding_bwd, et.head_fwd + et.head_bwd
    if problem.options.vpp > 1:  # the busiest rank does at least the average rank's work
        return SAFETY * nmb * (u * layers + emb + head) / pp
    if u <= 0:
        return SAFETY * u * _min_max_prefix(layers, pp, nmb)
    # Stage k cannot start before micro-batch 0's forward reached it (the embedding's forward on stage 0)
    # nor finish before the last backward went back through the stages before it (the embedding's
    # backward); the first stage runs the embedding and the last the LM head for every micro-batch.
    const = [(emb if k > 0 else 0.0) + nmb * ((emb if k == 0 else 0.0) + (head if k == pp - 1 else 0.0))
             for k in range(pp)]
    return SAFETY * max(_min_max_with_edges(layers, nmb, u, const), u * _min_max_prefix(layers, pp, nmb))
