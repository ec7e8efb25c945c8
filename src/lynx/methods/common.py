"""What every planning method shares: the base partition and applying a per-stage policy function."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from lynx.errors import SpecError
from lynx.graph import LayerGraph
from lynx.partition.base import Partition
from lynx.partition.dp import dp_partition
from lynx.policy.base import RecomputePolicy, StageContext
from lynx.problem import PlanProblem, PlanResult
from lynx.simulate import simulate

MethodFn = Callable[[PlanProblem], PlanResult]
StagePolicyFn = Callable[[StageContext, LayerGraph], RecomputePolicy]


def base_partition(problem: PlanProblem) -> Partition:
    """The user's explicit partition if given, else the paper's dp (parameter-balanced) partitioning
    (over the virtual stages when interleaved)."""
    lps = problem.options.layers_per_stage
    if lps is not None:
        return Partition(tuple(lps), method="explicit")
    return dp_partition(problem.model, problem.parallel, problem.options.vpp)


def megatron_partition(problem: PlanProblem) -> Partition:
    """The partition stock Megatron-Core runs, for its baselines: the user's explicit layout if given (what
    ``--pipeline-model-parallel-layout``, ``--decoder-first/last-pipeline-num-layers`` or
    ``--account-for-embedding/loss-in-pipeline-split`` produce; `lynx plan --from-megatron` passes it as
    `layers_per_stage`), else Megatron's default even split, num_layers / (PP x VPP) layers per virtual stage.
    Megatron refuses a split that does not divide (megatron/core/transformer/transformer_block.py,
    get_num_layers_to_build: "num_layers should be divisible by pipeline_model_parallel_size", and by
    PP x VPP when interleaved), so this raises SpecError with that reason instead of inventing one."""
    lps = problem.options.layers_per_stage
    if lps is not None:
        return Partition(tuple(lps), method="explicit")
    layers, pp, vpp = problem.model.num_layers, problem.parallel.pp, problem.options.vpp
    n = pp * vpp
    if layers % n:
        what = f"PP {pp}" if vpp == 1 else f"PP {pp} x VPP {vpp} = {n}"
        raise SpecError(f"Megatron refuses this layout: {layers} layers do not divide by {what} (no even split; "
                        "give --layers-per-stage, as Megatron needs --decoder-first/last-pipeline-num-layers or "
                        "a --pipeline-model-parallel-layout)")
    return Partition.interleaved((layers // n,) * n, pp, method="megatron")


def chunk_contexts(ctx: StageContext) -> tuple[StageContext, ...]:
    """One stand-alone context per model chunk of an interleaved stage (Megatron applies its recompute
    options to each chunk's block of layers); the stage itself when it has one chunk."""
    if not ctx.chunk_layers:
        return (ctx,)
    return tuple(dataclasses.replace(ctx, num_layers=n, chunk_layers=(), chunk_in_flight=(),
                                live_vectors=(), in_flight=f)
                 for n, f in zip(ctx.chunk_layers, ctx.chunk_in_flight, strict=True))


def stage_policy(fn: StagePolicyFn, ctx: StageContext, graph: LayerGraph) -> RecomputePolicy:
    """`fn` on the stage, chunk by chunk when interleaved (the chunks' layers concatenated, chunk 0 first)."""
    parts = [fn(c, graph) for c in chunk_contexts(ctx)]
    if len(parts) == 1:
        return parts[0]
    return dataclasses.replace(parts[0], layers=tuple(lp for p in parts for lp in p.layers))


def per_stage(problem: PlanProblem, name: str, fn: StagePolicyFn, partition: Partition | None = None) -> PlanResult:
    """Apply a per-stage policy function on a fixed partition (default: dp or the user's)."""
    t0 = time.perf_counter()
    part = partition or base_partition(problem)
    pols = tuple(stage_policy(fn, ctx, problem.graph) for ctx in problem.stage_contexts(part))
    return PlanResult(name, part, pols, search_time_s=time.perf_counter() - t0)


def iteration_time(problem: PlanProblem, part: Partition, pols: tuple[RecomputePolicy, ...]) -> float:
    """The simulator's iteration time, infinite when a stage runs out of memory."""
    sim = simulate(problem, part, pols, record=False)
    return float("inf") if sim.oom else sim.iteration_time_s


def edge_times_per_stage(problem: PlanProblem) -> list[float]:
    """Embedding on the first stage, LM head + loss on the last (as the simulator charges them)."""
    from lynx.edge_pricing import stage_edge_times

    par = problem.parallel
    edge = [0.0] * par.pp
    if problem.options.include_edges:  # the simulator's prices (a profiled graph's measured device)
        et = stage_edge_times(problem.model, problem.hardware, par, problem.graph)
        edge[0] += et.embedding_fwd + et.embedding_bwd
        edge[-1] += et.head_fwd + et.head_bwd
    return edge
