"""What an exporter reads from a plan: the problem, the layout in virtual-stage order, one policy per
virtual stage, and the model family."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lynx.errors import PlanFormatError
from lynx.export.layout import ChunkLayout
from lynx.policy.base import RecomputePolicy
from lynx.problem import PlanProblem, PlanResult


@dataclass(frozen=True, slots=True)
class ExportSource:
    problem: PlanProblem
    result: PlanResult
    layout: ChunkLayout
    policies: tuple[RecomputePolicy, ...]
    """One per virtual stage, in the layout's order."""
    family: str = "gpt"

    @property
    def graph_ops(self) -> tuple[str, ...]:
        return self.problem.graph.names


def source_from(problem: PlanProblem, result: PlanResult) -> ExportSource:
    """Read the layout off a planning result.

    Today's plans have one chunk per stage (vpp = 1). Interleaved plans (issue 9) carry `vpp` and v chunks
    per rank in Megatron's order (chunk c of rank r = virtual stage c * pp + r); the two `getattr`s below
    are the only lines that depend on how those fields end up named.
    """
    pp = problem.parallel.pp
    part = result.partition
    counts = tuple(int(x) for x in (getattr(part, "layers_per_chunk", None) or part.layers_per_stage))
    vpp = int(getattr(problem.parallel, "vpp", 0) or getattr(part, "vpp", 0) or max(1, len(counts) // pp))
    if len(counts) != pp * vpp:
        raise PlanFormatError(f"plan: partition {counts} does not give {vpp} chunk(s) to each of {pp} stages")
    if len(result.policies) != len(counts):
        raise PlanFormatError(f"plan: {len(result.policies)} stage policies for {len(counts)} (virtual) stages")
    for v, (pol, n) in enumerate(zip(result.policies, counts, strict=True)):
        if len(pol.layers) != n:
            raise PlanFormatError(f"plan: stage {v} policy covers {len(pol.layers)} layers, partition says {n}")
    family = str(getattr(problem.model, "family", "gpt"))
    return ExportSource(problem, result, ChunkLayout(pp, vpp, counts), result.policies, family)


def load_source(path: str | Path) -> ExportSource:
    from lynx.plan import load_plan

    problem, result = load_plan(path)
    return source_from(problem, result)
