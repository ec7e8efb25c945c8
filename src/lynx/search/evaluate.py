"""Planning one candidate of the search through the planner's public API, with what candidates share
cached: one layer graph per (TP, CP, SP, micro-batch) and one Lynx-HEU stage cache per graph, so a stage
problem (layers, in-flight micro-batches, budget, windows) is solved once across every layout that poses it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from lynx.api import KindGraphs, kind_layer_graphs, layer_graph, make_problem
from lynx.cost.memory import held_bytes, layer_memories
from lynx.errors import InfeasibleError, LynxError
from lynx.graph import LayerGraph
from lynx.methods import get_method
from lynx.methods.heu import heu_options, lynx_search
from lynx.plan import Plan
from lynx.policy.heu import HeuCache
from lynx.problem import PlanOptions, PlanProblem, PlanResult
from lynx.search.options import candidate_options
from lynx.search.space import Candidate, Layout, Space
from lynx.search.splits import Split
from lynx.simulate import SimResult, simulate
from lynx.spec import GiB, ParallelSpec
from lynx.stack import primary_kind

LYNX_SEARCHED = ("lynx", "lynx-offload")
"""Methods planned through `lynx_search` with the search's shared HEU caches (one per graph and method)."""
Status = Literal["planned", "does not fit", "over budget (bound)", "pruned (time bound)", "skipped (VPP sweep)",
                 "dominated", "invalid"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the search learned about one candidate: its figures when planned, else why not."""

    candidate: Candidate
    status: Status
    bound_s: float
    """Lower bound on its iteration time (seconds); nan when the layout was refused before pricing."""
    reason: str = ""
    iteration_s: float = math.nan
    tokens_per_s_per_gpu: float = math.nan
    tflops_per_gpu: float = math.nan
    mfu: float = math.nan
    stage_peak_gib: tuple[float, ...] = ()
    budget_gib: float = math.nan
    partition: tuple[int, ...] = ()
    plan: Plan | None = field(default=None, compare=False, repr=False)
    """lynx's plan of the candidate (what `--out` writes); its figures above are the target's price of it."""
    priced_for: str = "lynx"
    """The target whose price the figures are (`lynx.search.targets`): lynx's simulator of the plan itself, or
    what `lynx export megatron|torchtitan` prices for it."""
    runs_on: str = ""
    """What the row needs to run as priced (e.g. "Megatron-Core + lynx plugin"); empty before target pricing."""

    @property
    def fits(self) -> bool:
        return self.status == "planned"

    @property
    def headroom_gib(self) -> float:
        return self.budget_gib - max(self.stage_peak_gib, default=math.nan)


@dataclass
class Shared:
    """Caches shared by every candidate of one search."""

    space: Space
    base: PlanOptions
    graphs: dict[tuple[int, int, str, bool, int, int, int], LayerGraph] = field(default_factory=dict)
    kind_graphs: dict[tuple[int, int, str, bool, int, int, int], KindGraphs] = field(default_factory=dict)
    heu: dict[tuple[int, int, str, bool, int, int, int, str], HeuCache] = field(default_factory=dict)
    problems: dict[tuple[Layout, Split | None], PlanProblem] = field(default_factory=dict)

    def parallel(self, lay: Layout) -> ParallelSpec:
        s = self.space
        return ParallelSpec(tp=lay.tp, pp=lay.pp, dp=lay.dp, sequence_parallel=lay.sp, micro_batch_size=lay.mb,
                            global_batch_size=s.global_batch, seq_length=s.seq_len, cp=lay.cp,
                            cp_comm_type=lay.cp_comm_type, ep=lay.ep, etp=lay.etp)

    @staticmethod
    def _graph_key(lay: Layout) -> tuple[int, int, str, bool, int, int, int]:
        return (lay.tp, lay.cp, lay.cp_comm_type, lay.sp, lay.mb, lay.ep, lay.etp)

    def kinds(self, lay: Layout) -> KindGraphs:
        """One graph per layer kind for a model of several kinds (empty for one kind; docs/decisions/0221)."""
        key = self._graph_key(lay)
        if key not in self.kind_graphs:
            self.kind_graphs[key] = kind_layer_graphs(self.space.model, self.space.hardware, self.parallel(lay),
                                                      self._graph_options(lay))
        return self.kind_graphs[key]

    def _graph_options(self, lay: Layout) -> PlanOptions:
        """The options a layout's graph is priced with: the candidate's own, so that the production overlaps the
        search turns on per layout (--tp-comm-overlap with SP) are in its graph as they are in the plan file it
        writes (they depend on the graph key's TP and SP alone)."""
        return candidate_options(self.base, self.space, lay, None)

    def graph(self, lay: Layout) -> LayerGraph:
        """The layer graph (the primary kind's where the model has several)."""
        key = self._graph_key(lay)
        kinds = self.kinds(lay)
        if kinds:
            return dict(kinds)[primary_kind(self.space.model)]
        if key not in self.graphs:
            # the request's graph: the same options (--tp-comm-overlap) as `lynx plan` of this layout prices
            self.graphs[key] = layer_graph(self.space.model, self.space.hardware, self.parallel(lay),
                                           self._graph_options(lay))
        return self.graphs[key]

    def problem(self, lay: Layout, split: Split | None = None) -> PlanProblem:
        """The layout's problem; `split`: the Megatron-Core split a stock candidate runs (None: lynx's own)."""
        key = (lay, split)
        if key not in self.problems:
            opts = candidate_options(self.base, self.space, lay, split)
            self.problems[key] = make_problem(self.space.model, self.space.hardware, self.parallel(lay), opts,
                                              self.graph(lay), self.kinds(lay))
        return self.problems[key]

    def heu_cache(self, problem: PlanProblem, lay: Layout, method: str = "lynx") -> HeuCache:
        key = (*self._graph_key(lay), method)
        cache = self.heu.get(key)
        if cache is None:
            cache = HeuCache(problem.graph, heu_options(problem, method), kind_graphs=problem.kind_graphs)
            self.heu[key] = cache
        return cache


def _result(shared: Shared, cand: Candidate, problem: PlanProblem, refine: bool) -> PlanResult:
    if cand.method in LYNX_SEARCHED:
        return lynx_search(problem, cand.method, shared.heu_cache(problem, cand.layout, cand.method), refine,
                           explain=False)[0]
    return get_method(cand.method).fn(problem)  # stock methods partition as Megatron does (its split flags)


def _held_over_budget(problem: PlanProblem, result: PlanResult) -> str:
    """The stages whose static memory plus the activations held for their in-flight micro-batches (the
    closed form `memory.held_bytes`, which the simulated peak includes) already exceed the budget: such a
    plan runs out of memory whatever the simulation adds, so it is not simulated."""
    bad = []
    for pol, ctx in zip(result.policies, problem.stage_contexts(result.partition), strict=True):
        need = ctx.static_bytes + held_bytes(layer_memories(problem.graphs_for(ctx), pol.layers), ctx)
        if need > ctx.budget_bytes:
            bad.append(f"stage {ctx.stage} holds {need / GiB:.1f} GiB")
    return f"{', '.join(bad)} before any working memory (budget {problem.budget_bytes / GiB:.1f} GiB)" if bad else ""


PolicyBound = Callable[[PlanProblem, PlanResult], float]
"""A lower bound on a planned result's iteration time, before its simulation (`tree.Frontier.policy_bound`)."""


Failed = tuple[Status, str]
"""A candidate's method found no plan: the status and the reason, as `Outcome` records them."""


def plan_result(shared: Shared, cand: Candidate, refine: bool = False) -> PlanResult | Failed:
    """The candidate's method on its problem (the policies and partition, not yet simulated), or why it has none.
    A pure function of the search's space and options and the candidate: a worker process of
    `lynx.search.parallel` computes it on its own `Shared` and the search finishes it with `plan_candidate`."""
    problem = shared.problem(cand.layout, cand.split if cand.stock else None)
    try:
        return _result(shared, cand, problem, refine)
    except InfeasibleError as e:
        return "does not fit", f"no policy fits: {str(e).splitlines()[0]}"
    except LynxError as e:
        return "invalid", str(e).splitlines()[0]
    except ValueError as e:  # HEU's model builder on a budget below any policy (reported; see the report)
        return "does not fit", f"planner: {e}"


def presimulate(shared: Shared, cand: Candidate, result: PlanResult | Failed) -> SimResult | None:
    """What `plan_candidate` would simulate of the candidate's `plan_result`, computed ahead (a worker's, beside
    its plan: a pure function of the same problem): None where it would simulate nothing (no plan, held
    activations over budget) or the simulator refuses the policy (`plan_candidate` then says why), and for stock
    candidates, which the search's policy bound prunes before simulation more often than not (Megatron's block on
    the 405B / 1,024 H100 search): their simulation is left to the search."""
    if isinstance(result, tuple) or cand.stock:
        return None
    problem = shared.problem(cand.layout, None)
    if _held_over_budget(problem, result):
        return None
    try:
        return simulate(problem, result.partition, result.policies, record=False)
    except LynxError:
        return None


def plan_candidate(shared: Shared, cand: Candidate, bound_s: float, refine: bool = False,
                   prune_above: float = math.inf, policy_bound: PolicyBound | None = None,
                   planned: PlanResult | Failed | None = None, simulated: SimResult | None = None) -> Outcome:
    """Plan and simulate one candidate (stock candidates on Megatron-Core's even split); `refine`: lynx's
    simulator-judged partition refinement too (the search gives it to its finalists only). `policy_bound`: once
    the method has chosen its policies, their bound; above `prune_above` (what the search's incumbents need) the
    candidate is pruned unsimulated. `planned`: `plan_result` of the candidate with this `refine`, computed
    ahead (by a worker process); None: computed here. `simulated`: `presimulate` of that result, computed ahead
    with it (it is not over budget then); None: simulated here when needed."""
    problem = shared.problem(cand.layout, cand.split if cand.stock else None)
    result = plan_result(shared, cand, refine) if planned is None else planned
    if isinstance(result, tuple):
        return Outcome(cand, result[0], bound_s, result[1])
    part = result.partition
    over = "" if simulated is not None else _held_over_budget(problem, result)
    if over:
        return Outcome(cand, "does not fit", bound_s, over, partition=part.layers_per_stage)
    if policy_bound is not None and math.isfinite(prune_above):
        bound_s = max(bound_s, policy_bound(problem, result))
        if bound_s > prune_above:
            note = f" ({'; '.join(result.notes)})" if result.notes else ""
            return Outcome(cand, "pruned (time bound)", bound_s, f"time bound {bound_s:.3f} s with its policy{note} "
                           "exceeds what the search's best need", partition=part.layers_per_stage)
    try:
        plan = Plan(problem, result, simulated) if simulated is not None else Plan.evaluate(problem, result,
                                                                                              record=False)
    except LynxError as e:  # a method's policy the simulator refuses (a planner bug, reported as such)
        return Outcome(cand, "invalid", bound_s, f"the simulator refuses the policy: {str(e).splitlines()[0]}",
                       partition=part.layers_per_stage)
    s = plan.sim
    status: Status = "does not fit" if s.oom else "planned"
    oom = [st.stage for st in s.stages if st.oom]
    return Outcome(
        cand, status, bound_s, f"stage(s) {','.join(map(str, oom))} over budget in simulation" if oom else "",
        iteration_s=s.iteration_time_s, tokens_per_s_per_gpu=s.tokens_per_s / problem.parallel.world_size,
        tflops_per_gpu=s.model_tflops_per_gpu, mfu=s.mfu,
        stage_peak_gib=tuple(st.peak_memory_bytes / GiB for st in s.stages),
        budget_gib=problem.budget_bytes / GiB, partition=part.layers_per_stage, plan=plan,
    )
