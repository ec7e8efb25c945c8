"""The planner's public entry points: build a problem from specs, plan it with a method, compare methods.
No torch here: `lynx plan` for a 175B model answers on a laptop."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lynx.costmodel import build_layer_graph
from lynx.errors import InfeasibleError, LynxError, SpecError
from lynx.graph import LayerGraph
from lynx.methods import available_methods, get_method
from lynx.plan import Plan
from lynx.problem import PlanOptions, PlanProblem
from lynx.spec import Hardware, ModelSpec, ParallelSpec, validate_layout


def make_problem(
    model: ModelSpec,
    hardware: Hardware,
    parallel: ParallelSpec,
    options: PlanOptions | None = None,
    graph: LayerGraph | None = None,
) -> PlanProblem:
    """Validate the layout and build the layer graph (analytic unless a profiled graph is given)."""
    opts = options or PlanOptions()
    validate_layout(model, hardware, parallel, opts.nodes)
    if opts.layers_per_stage is not None:
        lps = opts.layers_per_stage
        if len(lps) != parallel.pp or sum(lps) != model.num_layers or min(lps) < 1:
            raise SpecError(
                f"--layers-per-stage {','.join(map(str, lps))}: needs {parallel.pp} positive entries "
                f"summing to {model.num_layers}"
            )
    _check_vpp(opts.vpp, model, parallel, opts.layers_per_stage is not None)
    if graph is None:
        graph = build_layer_graph(model, hardware, parallel)
    else:
        _check_graph_matches(graph, model, parallel)
    return PlanProblem(model, hardware, parallel, graph, opts)


def _check_vpp(vpp: int, model: ModelSpec, par: ParallelSpec, explicit: bool) -> None:
    """Interleaved 1F1B needs Megatron's conditions: pp > 1, a multiple of pp micro-batches, a layer per
    virtual stage (the schedule package states the micro-batch rule too; this names the options)."""
    if vpp < 1:
        raise SpecError(f"--vpp must be at least 1, got {vpp}")
    if vpp == 1:
        return
    if par.pp < 2:
        raise SpecError(f"--vpp {vpp} needs pipeline parallelism (--pp >= 2), got --pp {par.pp}")
    if par.num_microbatches % par.pp:
        raise SpecError(f"--vpp {vpp}: interleaved 1F1B needs the number of micro-batches ({par.num_microbatches}) "
                        f"to be a multiple of --pp {par.pp} (Megatron-Core's rule)")
    if model.num_layers < par.pp * vpp:
        raise SpecError(f"--vpp {vpp}: {model.num_layers} layers cannot fill {par.pp} x {vpp} virtual stages")
    if explicit:
        raise SpecError("--layers-per-stage cannot be combined with --vpp > 1 (chunks are split by lynx)")


def _check_graph_matches(graph: LayerGraph, model: ModelSpec, par: ParallelSpec) -> None:
    m = graph.meta
    want = {"hidden_size": model.hidden_size, "num_attention_heads": model.num_attention_heads,
            "seq_length": par.seq_length, "micro_batch_size": par.micro_batch_size, "tp": par.tp,
            "sequence_parallel": par.sequence_parallel, "family": model.family,
            "num_query_groups": model.num_query_groups}
    bad = [f"{k} {getattr(m, k)} (layout: {v})" for k, v in want.items() if getattr(m, k) not in (v, 0)]
    if bad:
        raise SpecError("the profiled graph does not match the layout: " + ", ".join(bad))


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


def compare(
    problem: PlanProblem,
    methods: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[CompareRow]:
    """Every method side by side, in one run (the product's first screen)."""
    names = list(methods) if methods is not None else [
        n for n in available_methods() if get_method(n).in_compare
    ]
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
