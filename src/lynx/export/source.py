"""What an exporter reads from a plan: the problem, the layout in virtual-stage order, one policy per
virtual stage, and the model family."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lynx.decisions import RecomputePolicy
from lynx.errors import PlanFormatError
from lynx.export.layout import ChunkLayout
from lynx.plan import policies_per_virtual_stage
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

    Today's plans have one chunk per stage (vpp = 1). Interleaved plans carry
    `partition.chunks`, the layers of every virtual stage in model order (chunk c of rank r = virtual stage
    c * pp + r), and one policy per rank whose layers run chunk 0 first; this function is the only place
    that reads those fields (by `getattr`), and splits each rank's policy into its chunks.
    """
    pp = problem.parallel.pp
    part = result.partition
    counts = tuple(int(x) for x in (getattr(part, "chunks", ()) or part.layers_per_stage))
    vpp = max(1, len(counts) // pp)
    if len(counts) != pp * vpp:
        raise PlanFormatError(f"plan: partition {counts} does not give {vpp} chunk(s) to each of {pp} stages")
    pols = result.policies
    if vpp > 1 and len(pols) == pp:
        pols = policies_per_virtual_stage(pols, counts, pp, vpp)
    if len(pols) != len(counts):
        raise PlanFormatError(f"plan: {len(pols)} stage policies for {len(counts)} (virtual) stages")
    for v, (pol, n) in enumerate(zip(pols, counts, strict=True)):
        if len(pol.layers) != n:
            raise PlanFormatError(f"plan: stage {v} policy covers {len(pol.layers)} layers, partition says {n}")
    family = str(getattr(problem.model, "family", "gpt"))
    return ExportSource(problem, result, ChunkLayout(pp, vpp, counts), pols, family)


def load_source(path: str | Path) -> ExportSource:
    from lynx.plan import load_plan

    problem, result = load_plan(path)
    return source_from(problem, result)
