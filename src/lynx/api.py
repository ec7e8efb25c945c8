"""The planner's public entry points: build a problem from specs, plan it with a method, compare methods.
No torch here: `lynx plan` for a 175B model answers on a laptop."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lynx.checks import check_graph_matches, check_inputs
from lynx.cost.layer import CostParams, build_layer_graph
from lynx.errors import InfeasibleError, LynxError, SpecError
from lynx.graph import LayerGraph
from lynx.methods import available_methods, get_method
from lynx.plan import Plan
from lynx.problem import PlanOptions, PlanProblem
from lynx.spec import Hardware, ModelSpec, ParallelSpec
from lynx.stack import LayerKind, is_uniform, kinds_present, primary_kind

KindGraphs = tuple[tuple[LayerKind, LayerGraph], ...]
"""One analytic layer graph per layer kind of a model whose layers are of several kinds (docs/decisions/0221)."""


def layer_graph(model: ModelSpec, hardware: Hardware, parallel: ParallelSpec, options: PlanOptions,
                kind: LayerKind | None = None) -> LayerGraph:
    """The analytic layer graph every command prices with, the options that change a layer's ops applied
    (`--tp-comm-overlap`): `make_problem` and the configuration search's graph cache both build it here, so a
    candidate the search prices and the same layout planned alone price the same graph (lynx.request).
    `kind`: a layer of that kind (`lynx.stack`; default the model's primary kind)."""
    return build_layer_graph(model, hardware, parallel, CostParams.for_hardware(hardware, options.tp_comm_overlap),
                             kind)


def kind_layer_graphs(model: ModelSpec, hardware: Hardware, parallel: ParallelSpec,
                      options: PlanOptions) -> KindGraphs:
    """`layer_graph` of each kind the model's layers have; empty when they are all of one kind."""
    if is_uniform(model):
        return ()
    return tuple((k, layer_graph(model, hardware, parallel, options, k)) for k in kinds_present(model))


def make_problem(
    model: ModelSpec,
    hardware: Hardware,
    parallel: ParallelSpec,
    options: PlanOptions | None = None,
    graph: LayerGraph | None = None,
    kind_graphs: KindGraphs = (),
) -> PlanProblem:
    """Validate the layout and build the layer graph (analytic unless a profiled graph is given); a model of
    several layer kinds takes one graph per kind (`kind_graphs`: built already, e.g. a plan file's or the search's
    cache; else analytic) and no profiled graph."""
    opts = options or PlanOptions()
    check_inputs(model, hardware, parallel, opts)
    if not is_uniform(model):  # one graph per layer kind (docs/decisions/0221)
        if graph is not None and not kind_graphs:
            raise SpecError(f"a profiled graph measures one layer; {model.name} has layers of several kinds "
                            f"({', '.join(kinds_present(model))}): plan it with the analytic model (no --profile)")
        kinds = kind_graphs or kind_layer_graphs(model, hardware, parallel, opts)
        return PlanProblem(model, hardware, parallel, dict(kinds)[primary_kind(model)], opts, kinds)
    if graph is None:
        graph = layer_graph(model, hardware, parallel, opts)
    else:
        check_graph_matches(graph, model, parallel)
    return PlanProblem(model, hardware, parallel, graph, opts)


def plan(problem: PlanProblem, method: str, record: bool = True) -> Plan:
    """Plan with one method and simulate the result (`record`: keep the timeline for plots)."""
    fn = get_method(method).fn
    return Plan.evaluate(problem, fn(problem), record)


@dataclass(frozen=True, slots=True)
class CompareRow:
    method: str
    plan: Plan | None
    error: str = ""
    """Why the method gave no plan (e.g. no policy fits the budget)."""
    seconds: float = 0.0


def compare_methods(problem: PlanProblem) -> list[str]:
    """The methods `compare` runs by default: those in the comparison, Megatron's MoE modules for a model with
    experts, and a framework's own baseline (torchtitan's SelectiveAC) for its family's 16-bit models."""
    return [n for n in available_methods() if get_method(n).in_compare
            or (problem.model.is_moe and get_method(n).moe_only)
            or (get_method(n).family == problem.model.family and problem.model.fp8 is None)]


def compare(
    problem: PlanProblem,
    methods: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[CompareRow]:
    """Every method side by side, in one run (the product's first screen)."""
    names = list(methods) if methods is not None else compare_methods(problem)
    rows: list[CompareRow] = []
    for n in names:
        if progress is not None:
            progress(n)
        t0 = time.perf_counter()
        try:
            rows.append(CompareRow(n, plan(problem, n, record=False), seconds=time.perf_counter() - t0))
        except InfeasibleError as e:
            rows.append(CompareRow(n, None, str(e), time.perf_counter() - t0))
        except LynxError as e:
            rows.append(CompareRow(n, None, f"error: {e}", time.perf_counter() - t0))
    return rows
