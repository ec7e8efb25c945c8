"""The simulator: an interpreter of any valid action list (`lynx.schedule`) that judges every plan,
whoever produced it (PyTorch's knapsack_evaluator spirit). Pricing per action (`pricing`), the event loop
(`engine`), memory event by event (`memory_replay`) and the iteration's metrics (`metrics`) are separate
pieces; docs/costmodel.md has the time model.

Cool-down backwards have no later forward to host phase-1/2 work: it hides in the stall before them when
the policy allows, else runs on demand. After the last backward: optional data-parallel gradient
all-reduce and the optimizer step.
"""

from __future__ import annotations

import dataclasses

from lynx.cost.collectives import p2p_time
from lynx.cost.edges import device_hardware, stage_edge_times
from lynx.cost.runtime import tied_embedding_sync_time
from lynx.cost.stage import ChunkCosts
from lynx.decisions import RecomputePolicy, StageContext
from lynx.partition.base import Partition
from lynx.policy.offload import offload_link, stage_exposed_copy
from lynx.problem import PlanProblem
from lynx.schedule import Schedule, ScheduleFacts, derive_facts, validate
from lynx.simulate.copies import copy_segments, stage_offload_bytes
from lynx.simulate.engine import Loop, RankState, checked, hosts, priced
from lynx.simulate.memory_replay import StageMemory
from lynx.simulate.metrics import DpOverlap, tail_time, throughput
from lynx.simulate.results import Segment, SegmentKind, SimResult, StageResult
from lynx.spec import Hardware

__all__ = ["Segment", "SegmentKind", "SimResult", "StageResult", "simulate", "simulate_time"]


def _facts(problem: PlanProblem, partition: Partition, schedule: Schedule | None) -> ScheduleFacts:
    p = problem.parallel.pp
    if schedule is None:
        return problem.facts
    validate(schedule)
    if schedule.pp != p or schedule.num_chunks != partition.num_chunks:
        raise ValueError(f"schedule has {schedule.pp} ranks x {schedule.num_chunks} chunks; the plan "
                         f"{p} x {partition.num_chunks}")
    return derive_facts(schedule)


def _p2p(problem: PlanProblem) -> float:
    par = problem.parallel
    # One layer input in the graph's own dtype (a profiled fp32 graph sends 4 bytes per element), split over
    # the TP ranks: Megatron's scatter-gather send, or the sequence-parallel shard the layer already holds.
    g = problem.graph
    nbytes = g.input_bytes if par.sequence_parallel else g.input_bytes / par.tp
    link = problem.hardware.link_for_group(2, par.tp * par.cp * par.dp)
    return p2p_time(nbytes, link) if par.pp > 1 else 0.0


def _device_hardware(problem: PlanProblem) -> Hardware:
    """The hardware that prices work outside the layer graph (`lynx.cost.pricing.device_hardware`)."""
    return device_hardware(problem.hardware, problem.graph)


def _costs(problem: PlanProblem, policies: tuple[RecomputePolicy, ...],
           ctxs: tuple[StageContext, ...]) -> list[list[ChunkCosts]]:
    g = problem.graph
    # embedding on the first virtual stage, LM head + loss on the last
    et = stage_edge_times(problem.model, problem.hardware, problem.parallel, g) if problem.options.include_edges \
        else None
    link = offload_link(problem.hardware) if any(lp.offload for pol in policies for lp in pol.layers) else None
    return [priced(problem.graphs_for(ctx), pol, ctx, et,
                   stage_exposed_copy(g, pol.layers, ctx, link) if link is not None else 0.0)
            for pol, ctx in zip(policies, ctxs, strict=True)]


def simulate(
    problem: PlanProblem,
    partition: Partition,
    policies: tuple[RecomputePolicy, ...],
    p2p_s: float | None = None,
    record: bool = True,
    schedule: Schedule | None = None,
) -> SimResult:
    """Simulate one training iteration of `policies` on `partition` under `schedule` (default: the problem's
    own, 1F1B or interleaved 1F1B); validates every policy and a given schedule first."""
    par = problem.parallel
    p = par.pp
    if partition.num_stages != p or len(policies) != p:
        raise ValueError(f"plan has {partition.num_stages} stages and {len(policies)} policies for PP {p}")
    facts = _facts(problem, partition, schedule)
    ctxs = problem.stage_contexts(partition, facts)
    _check(problem, policies, ctxs)
    costs = _costs(problem, policies, ctxs)
    ranks = [RankState(costs[r], ctxs[r], policies[r],
                       StageMemory(problem.graphs_for(ctxs[r]), policies[r], ctxs[r], record),
                       *hosts(facts, r), ctxs[r].has_fwd_windows) for r in range(p)]
    loop = Loop(facts, ranks, _p2p(problem) if p2p_s is None else p2p_s, record)
    loop.run()
    return _result(problem, ctxs, loop)


def _check(problem: PlanProblem, policies: tuple[RecomputePolicy, ...], ctxs: tuple[StageContext, ...]) -> None:
    """Every policy valid on its stage (`engine.checked`), and no offloading in a model of several layer kinds."""
    if problem.heterogeneous and any(lp.offload for pol in policies for lp in pol.layers):
        raise ValueError("offloading is not priced for models of several layer kinds yet")
    for pol, ctx in zip(policies, ctxs, strict=True):
        checked(problem.graphs_for(ctx), pol, ctx)


def simulate_time(problem: PlanProblem, partition: Partition, policies: tuple[RecomputePolicy, ...]) -> float:
    """`simulate(...).iteration_time_s` without the memory replay (`RankState.memory` None): the same loop and the
    same floating-point operations on the times, which no memory figure feeds, so the same float. For a caller that
    reads only the time (`methods.common.plain_time`, the search's plain bounds: no stage's memory is asked
    there); validates every policy as `simulate` does."""
    par = problem.parallel
    if partition.num_stages != par.pp or len(policies) != par.pp:
        raise ValueError(f"plan has {partition.num_stages} stages and {len(policies)} policies for PP {par.pp}")
    facts = problem.facts
    ctxs = problem.stage_contexts(partition, facts)
    _check(problem, policies, ctxs)
    costs = _costs(problem, policies, ctxs)
    ranks = [RankState(costs[r], ctxs[r], policies[r], None, *hosts(facts, r), ctxs[r].has_fwd_windows)
             for r in range(par.pp)]
    loop = Loop(facts, ranks, _p2p(problem), False)
    loop.run()
    return max(st.ready for st in ranks) + _tail(problem, ctxs, ranks)


def _tail(problem: PlanProblem, ctxs: tuple[StageContext, ...], ranks: list[RankState]) -> float:
    """What follows the pipeline's last backward (`metrics.tail_time`: DP synchronisation, the optimizer step)."""
    par = problem.parallel
    ready = [st.ready for st in ranks]
    tail = 0.0
    if problem.options.include_dp_allreduce:
        sync = 0.0
        if problem.graph.runtime is not None:  # what the runtime does that analytic plans leave out
            sync = tied_embedding_sync_time(problem.model, par, problem.hardware, problem.static_recipe.grad_bytes)
        o = problem.options
        overlap = DpOverlap(o.overlap_grad_reduce, o.overlap_param_gather, o.ddp_bucket_size,
                            tuple(sum(c.bwd_base for c in st.costs) for st in ranks),
                            tuple(sum(c.fwd_plain for c in st.costs) for st in ranks),
                            tuple(tuple(c.bwd_base for c in st.costs) for st in ranks),
                            tuple(tuple(c.fwd_plain for c in st.costs) for st in ranks),
                            o.check_for_nan_in_grad, o.ddp_average_in_collective)
        tail = tail_time(problem.model, _device_hardware(problem), par, ctxs, ready, problem.static_recipe,
                         o.distributed_optimizer, sync, overlap, problem.dp_sharding)
    return tail


def _kept(memories: list[StageMemory | None]) -> list[StageMemory]:
    """The stages' memory replays (`simulate` always keeps them; `simulate_time` returns before any result)."""
    out = [m for m in memories if m is not None]
    assert len(out) == len(memories)
    return out


def _result(problem: PlanProblem, ctxs: tuple[StageContext, ...], loop: Loop) -> SimResult:
    par, ranks = problem.parallel, loop.ranks
    memories = [st.memory for st in ranks]
    pipeline_time = max(st.ready for st in ranks)
    iteration = pipeline_time + _tail(problem, ctxs, ranks)
    samples, tflops, mfu = throughput(problem.model, problem.hardware, par, iteration)
    stages = tuple(
        StageResult(
            stage=s, num_layers=ctxs[s].num_layers, fwd_time_s=sum(c.fwd_plain for c in st.costs),
            bwd_time_s=sum(c.bwd_base for c in st.costs), busy_time_s=st.busy,
            peak_memory_bytes=mem.peak, budget_bytes=ctxs[s].budget_bytes,
            static_bytes=ctxs[s].static_bytes, recompute_critical_s=st.crit, recompute_overlapped_s=st.hidden,
            recompute_total_s=st.crit + st.hidden,
        )
        for s, (st, mem) in enumerate(zip(ranks, _kept(memories), strict=True))
    )
    offloads = any(lp.offload for st in ranks for lp in st.policy.layers)
    if offloads:
        m = par.num_microbatches
        off = [stage_offload_bytes(problem.graph, st.policy, ctxs[s]) for s, st in enumerate(ranks)]
        stages = tuple(dataclasses.replace(r, copy_exposed_s=m * sum(c.copy_exposed for c in ranks[s].costs),
                                           offloaded_bytes=off[s][0], host_bytes=off[s][1])
                       for s, r in enumerate(stages))
    segments = tuple(loop.segments)
    if offloads and loop.record:
        segments += tuple(copy_segments(problem.graph, tuple(st.policy for st in ranks),
                                        offload_link(problem.hardware), loop.segments))
    busy = sum(st.busy for st in ranks)
    bubble = 1.0 - busy / (par.pp * pipeline_time) if pipeline_time > 0 else 0.0
    return SimResult(
        iteration_time_s=iteration, pipeline_time_s=pipeline_time, samples_per_s=samples,
        tokens_per_s=samples * par.seq_length, model_tflops_per_gpu=tflops, mfu=mfu, bubble_fraction=bubble,
        stages=stages, segments=segments,
        memory_curves=tuple(tuple(m.curve) for m in _kept(memories)) if loop.record else (),
    )
