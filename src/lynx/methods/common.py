"""What every planning method shares: the base partition and applying a per-stage policy function."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from lynx.decisions import RecomputePolicy, StageContext
from lynx.errors import SpecError
from lynx.graph import Graphs, LayerGraph, per_layer
from lynx.partition.base import Partition
from lynx.partition.dp import dp_partition
from lynx.policy.rules import UniformLayers, none_policy
from lynx.problem import PlanProblem, PlanResult
from lynx.simulate import simulate, simulate_time

MethodFn = Callable[[PlanProblem], PlanResult]
StagePolicyFn = Callable[[StageContext, LayerGraph], RecomputePolicy]


def base_partition(problem: PlanProblem) -> Partition:
    """The user's explicit partition if given, else the paper's dp (parameter-balanced) partitioning
    (over the virtual stages when interleaved)."""
    lps = problem.options.layers_per_stage
    if lps is not None:  # per virtual stage in model order when interleaved (`cli.common.parse_layers`)
        return Partition.interleaved(tuple(lps), problem.parallel.pp, method="explicit")
    return dp_partition(problem.model, problem.parallel, problem.options.vpp)


REFUSED = "Megatron refuses this layout"
"""How a baseline's row starts when Megatron would not start with the layout (tests and benchmarks match it)."""


def megatron_partition(problem: PlanProblem) -> Partition:
    """The partition stock Megatron-Core runs, for its baselines. In Megatron's order of reading
    (megatron/core/transformer/transformer_block.py, get_num_layers_to_build): ``--decoder-first/last-pipeline-
    num-layers`` (the given ends, the rest evenly over the middle stages); else the user's explicit layout (what
    `lynx plan --from-megatron` passes as `layers_per_stage` for a command line's layout string or flags);
    else the even split, num_layers / (PP x VPP) per virtual stage, with ``--account-for-embedding/loss-in-
    pipeline-split`` counting the embedding / loss as one more layer on the first / last stage. Megatron asserts
    these divide ("num_layers should be divisible by pipeline_model_parallel_size"); when they do not, this
    raises SpecError with that reason instead of inventing a split."""
    o = problem.options
    layers, pp, vpp = problem.model.num_layers, problem.parallel.pp, o.vpp
    first, last = o.decoder_first_pipeline_num_layers, o.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        middle = pp - (first is not None) - (last is not None)
        rest = layers - (first or 0) - (last or 0)
        if rest < 0 or (middle == 0 and rest) or (middle > 0 and (rest % middle or rest == 0)):
            raise SpecError(f"{REFUSED}: --decoder-first/last-pipeline-num-layers {first}/{last} leave {rest} of "
                            f"{layers} layers, which do not split evenly over {middle} middle stage(s)")
        each = rest // middle if middle else 0
        counts = ([first] if first is not None else []) + [each] * middle + ([last] if last is not None else [])
        return _interleave(counts, vpp, 0, 0, "--decoder-first/last-pipeline-num-layers")
    if o.layers_per_stage is not None:
        return Partition.interleaved(tuple(o.layers_per_stage), pp, method="explicit")
    emb, loss = int(o.account_for_embedding_in_pipeline_split), int(o.account_for_loss_in_pipeline_split)
    n, total = pp * vpp, layers + emb + loss
    if total % n:
        what = f"PP {pp}" if vpp == 1 else f"PP {pp} x VPP {vpp} = {n}"
        extra = f" + {emb + loss} (embedding/loss)" if emb or loss else ""
        raise SpecError(f"{REFUSED}: {layers} layers{extra} do not divide by {what} (no even split; give "
                        "--layers-per-stage, as Megatron needs --decoder-first/last-pipeline-num-layers or a "
                        "--pipeline-model-parallel-layout)")
    return _interleave([total // pp] * pp, vpp, emb, loss, "--account-for-embedding/loss-in-pipeline-split")


def _interleave(per_rank: list[int], vpp: int, emb: int, loss: int, flag: str) -> Partition:
    """Megatron-Core's chunks from its layers per rank (get_num_layers_to_build): each rank's layers split evenly
    over its VPP chunks, then one layer fewer on the first / last virtual stage for the embedding / loss."""
    pp = len(per_rank)
    if any(n % vpp for n in per_rank):
        raise SpecError(f"{REFUSED}: {flag} gives {per_rank} layers per stage, not divisible by VPP {vpp}")
    chunks = [per_rank[r] // vpp for _ in range(vpp) for r in range(pp)]
    chunks[0] -= emb
    chunks[-1] -= loss
    if min(chunks) < 0 or any(sum(chunks[r::pp]) < 1 for r in range(pp)):
        raise SpecError(f"{REFUSED} here: {flag} leaves a pipeline stage without layers ({chunks})")
    # a virtual stage may hold the embedding or the loss alone (Megatron builds it with no transformer layer)
    return Partition.interleaved(tuple(chunks), pp, method="megatron")


_CHUNK_CONTEXTS: dict[int, tuple[StageContext, tuple[StageContext, ...]]] = {}
CHUNK_CONTEXT_ENTRIES = 4096
"""Interleaved stage contexts whose chunks `chunk_contexts` keeps (a search asks a stage's chunks for every policy
it prices there: a copy of each chunk's context per policy otherwise)."""


def chunk_contexts(ctx: StageContext) -> tuple[StageContext, ...]:
    """One stand-alone context per model chunk of an interleaved stage (Megatron applies its recompute
    options to each chunk's block of layers); the stage itself when it has one chunk. Kept per context object
    (the entry holds it, so its id is not reused while kept; contexts and their chunks are frozen)."""
    if not ctx.chunk_layers:
        return (ctx,)
    hit = _CHUNK_CONTEXTS.get(id(ctx))
    if hit is not None and hit[0] is ctx:
        return hit[1]
    out, lo = [], 0
    for n, f in zip(ctx.chunk_layers, ctx.chunk_in_flight, strict=True):
        out.append(dataclasses.replace(ctx, num_layers=n, chunk_layers=(), chunk_in_flight=(), live_vectors=(),
                                       in_flight=f, kinds=ctx.kinds[lo:lo + n]))
        lo += n
    if len(_CHUNK_CONTEXTS) >= CHUNK_CONTEXT_ENTRIES:
        _CHUNK_CONTEXTS.clear()
    _CHUNK_CONTEXTS[id(ctx)] = (ctx, tuple(out))
    return _CHUNK_CONTEXTS[id(ctx)][1]


def stage_policy(fn: StagePolicyFn, ctx: StageContext, graph: Graphs) -> RecomputePolicy:
    """`fn` on the stage, chunk by chunk when interleaved (the chunks' layers concatenated, chunk 0 first). With
    one graph per layer (several layer kinds), layer i takes its place's policy from `fn` on its kind's graph:
    Megatron's rules depend on a layer's position in the stage (uniform, block), never on its neighbours' kind."""
    if isinstance(fn, UniformLayers) and isinstance(graph, LayerGraph):  # every layer alike: the chunks' layers
        return fn(ctx, graph)
    gs = per_layer(graph, ctx.num_layers)
    parts, lo = [], 0
    for c in chunk_contexts(ctx):
        if c.num_layers:  # a chunk of Megatron's split may hold the embedding or the loss alone
            parts.append(_layerwise(fn, c, gs[lo:lo + c.num_layers]))
        lo += c.num_layers
    if len(parts) == 1:
        return parts[0]
    return dataclasses.replace(parts[0], layers=tuple(lp for p in parts for lp in p.layers))


def _layerwise(fn: StagePolicyFn, ctx: StageContext, gs: tuple[LayerGraph, ...]) -> RecomputePolicy:
    distinct = {id(g): g for g in gs}
    if len(distinct) == 1:
        return fn(ctx, gs[0])
    pols = {k: fn(ctx, g) for k, g in distinct.items()}
    first = pols[id(gs[0])]
    return dataclasses.replace(first, layers=tuple(pols[id(g)].layers[i] for i, g in enumerate(gs)))


def per_stage(problem: PlanProblem, name: str, fn: StagePolicyFn, partition: Partition | None = None) -> PlanResult:
    """Apply a per-stage policy function on a fixed partition (default: dp or the user's)."""
    t0 = time.perf_counter()
    part = partition or base_partition(problem)
    pols = tuple(stage_policy(fn, ctx, problem.graphs_for(ctx)) for ctx in problem.stage_contexts(part))
    return PlanResult(name, part, pols, search_time_s=time.perf_counter() - t0)


def one_kind_only(problem: PlanProblem, method: str) -> None:
    """Refuse a model of several layer kinds for a method that prices one layer graph (docs/decisions/0221)."""
    if problem.heterogeneous:
        kinds = ", ".join(k for k, _ in problem.kind_graphs)
        raise SpecError(f"--method {method} plans models whose layers are all of one kind; {problem.model.name} has "
                        f"{kinds} layers: use lynx, lynx-heu or a Megatron baseline (none, full, selective, uniform, "
                        "block, mc-*)")


def iteration_time(problem: PlanProblem, part: Partition, pols: tuple[RecomputePolicy, ...]) -> float:
    """The simulator's iteration time, infinite when a stage runs out of memory."""
    sim = simulate(problem, part, pols, record=False)
    return float("inf") if sim.oom else sim.iteration_time_s


def plain_time(problem: PlanProblem, part: Partition) -> float:
    """The simulated iteration time of `part` keeping every activation, memory aside: no policy on the partition
    is faster (recomputing an op, or copying it to the host and back, only ever adds time, on the critical path or
    in a window that would otherwise idle). The search's bound for a lynx interleaved node (`search.bounds.plain_s`)
    and the partition refinement's test before it solves a move's stage problems (`methods.heu._refine`)."""
    pols = per_stage(problem, "none", none_policy, part).policies
    return simulate_time(problem, part, pols)


def edge_times_per_stage(problem: PlanProblem) -> list[float]:
    """Embedding on the first stage, LM head + loss on the last (as the simulator charges them)."""
    from lynx.cost.edges import stage_edge_times

    par = problem.parallel
    edge = [0.0] * par.pp
    if problem.options.include_edges:  # the simulator's prices (a profiled graph's measured device)
        et = stage_edge_times(problem.model, problem.hardware, par, problem.graph)
        edge[0] += et.embedding_fwd + et.embedding_bwd
        edge[-1] += et.head_fwd + et.head_bwd
    return edge
