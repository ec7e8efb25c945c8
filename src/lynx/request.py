"""One request, one price: what is trained (model), where (hardware), how it is laid out (ParallelSpec) and every
option the price reads (PlanOptions: precision, optimizer sharding, overlaps, offload budget, split flags), plus
the method and the framework it will run on (`Target`).

A request is built once at the edge -- from command-line flags (`lynx.cli.common.build_request`), a model or
hardware YAML, a plan file (`Request.of_problem` on what `lynx.plan.load_plan` read), or a Megatron command line
(`lynx plan --from-megatron`) -- and every command prices from it: `lynx plan`, the configuration search
(`lynx plan --gpus`: the request's model, options and graph builder for every candidate), `lynx memory`,
`lynx simulate`, `lynx export` and the plots. `lynx.api.layer_graph` is the one place the options that change a layer's
ops (`--tp-comm-overlap`) reach the cost model, so a candidate the search prices and the same layout planned
alone price the same graph.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lynx.graph import LayerGraph
from lynx.problem import PlanOptions, PlanProblem
from lynx.spec import Hardware, ModelSpec, ParallelSpec

if TYPE_CHECKING:
    from lynx.api import KindGraphs
    from lynx.plan import Plan


class Target(enum.Enum):
    """The framework a plan is priced for (`lynx plan --gpus ... --target`): what that framework executes as
    `lynx export` writes it (`lynx.export.targets.target_price`)."""

    MEGATRON = "megatron"
    """Megatron-Core with lynx's exported flags and per-rank plugin (`lynx export megatron`)."""
    TORCHTITAN = "torchtitan"
    """torchtitan with its eager kernels and FSDP, the plan through lynx's engine or AC module
    (`lynx export torchtitan`)."""
    LYNX = "lynx"
    """lynx's own runtime (`lynx train`): the plan as planned, recomputation hidden in its windows."""


DEFAULT_TARGET = Target.MEGATRON
"""Megatron-Core is what most users run; a plan ranked by lynx's own runtime is only that fast where lynx's
runtime (or its engine) runs it (docs/decisions/0120-request-and-target.md)."""


def parse_target(text: str) -> Target:
    from lynx.errors import SpecError

    try:
        return Target(text)
    except ValueError:
        raise SpecError(f"--target {text!r}; valid: {', '.join(t.value for t in Target)}") from None


@dataclass(frozen=True, slots=True)
class Request:
    """Everything a price depends on; frozen, so one request gives one price wherever it is priced."""

    model: ModelSpec
    hardware: Hardware
    parallel: ParallelSpec
    options: PlanOptions = field(default_factory=PlanOptions)
    method: str = "lynx"
    target: Target = DEFAULT_TARGET
    graph: LayerGraph | None = field(default=None, compare=False, repr=False)
    """A profiled layer graph (`--profile`) in place of the analytic one."""
    kind_graphs: KindGraphs = field(default=(), compare=False, repr=False)
    """One graph per layer kind for a model of several kinds (a plan file's; empty: analytic, `lynx.stack`)."""

    def problem(self) -> PlanProblem:
        """The planning problem, validated (`lynx.api.make_problem`: layout, options, graph)."""
        from lynx.api import make_problem

        return make_problem(self.model, self.hardware, self.parallel, self.options, self.graph, self.kind_graphs)

    def plan(self, record: bool = False) -> Plan:
        """Plan with the request's method and simulate (lynx's own price of the plan)."""
        from lynx.api import plan

        return plan(self.problem(), self.method, record=record)

    @staticmethod
    def of_problem(problem: PlanProblem, method: str = "lynx", target: Target = DEFAULT_TARGET) -> Request:
        """The request a problem was built from (a plan file's; its graph kept, profiled or analytic)."""
        return Request(problem.model, problem.hardware, problem.parallel, problem.options, method, target,
                       problem.graph, problem.kind_graphs)
