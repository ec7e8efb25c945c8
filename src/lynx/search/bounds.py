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
* Time: a pipeline cannot finish before some rank r has received micro-batch 0 (the forwards of the virtual
  stages before its first, each a p2p transfer apart), run all its work, and sent the last backward down (the
  backwards of those virtual stages, p2p apart again): rank r's first action is micro-batch 0's forward on its
  chunk 0 (virtual stage r) and its last the last micro-batch's backward there, in 1F1B and in Megatron's
  interleaved 1F1B alike. With each layer costing at least its plain forward + backward `u`
  (`LayerGraph.step_time`, what the simulator charges before any recomputation or transfer; a model of several
  layer kinds: each layer its kind's, `Pieces.above`) and the embedding
  (first virtual stage) and LM head + loss (last) as the simulator charges them, the iteration takes at least
  max_r (embedding if r > 0 + u x layers of virtual stages 0..r-1 + 2 r p2p + micro-batches x (u x layers on r +
  its edges)), and at least one micro-batch's forward and backward through every virtual stage. On a known
  partition (a stock candidate's split) this is evaluated directly (`partition_time_bound_s`); for lynx's
  own partition it is minimised over every split: in 1F1B with the prefix of whole stages, interleaved with
  a layer per earlier virtual stage (`time_bound_s`).

Both bounds read the problem the planner would plan (its graph, its static-memory recipe), so a change of
the cost model moves them with it; tests/unit/test_search.py checks them against planned candidates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import accumulate
from operator import mul

from lynx.cost.edges import device_hardware, stage_edge_times
from lynx.cost.fsdp_time import fsdp_step_time
from lynx.cost.memory import layer_memories, stage_floor_bytes, stage_peak_bytes, static_bytes
from lynx.cost.pricing import layer_recompute, recompute_time
from lynx.cost.static_memory import grad_buffer_time, optimizer_step_time
from lynx.decisions import Phase
from lynx.graph import LayerGraph
from lynx.methods.common import plain_time, stage_policy
from lynx.methods.rules import fixed_layer_policy
from lynx.partition.base import Partition
from lynx.policy.megatron_offload import stock_offload_layer
from lynx.policy.rules import full_policy
from lynx.problem import PlanProblem, PlanResult
from lynx.simulate import _p2p as p2p_seconds
from lynx.stack import LayerKind, kinds_present, stage_kinds

SAFETY = 1.0 - 1e-9
"""The time bound multiplies by this: summing per-action times in another order may round differently."""
CHUNKED_METHODS = frozenset({"uniform"})
"""Methods whose layers may drop their input checkpoint (Megatron's uniform recompute chunks: one input per chunk).
`block` is not one: its first N layers are checkpointed one by one (each keeps its input) and the rest keep
everything (`policy.rules.block_policy`), so every layer holds at least its input, as lynx's do."""


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


def _stage_bytes(problem: PlanProblem, stage: int, n: int, per_layer_inputs: bool, static_only: bool = False) -> float:
    """`stage_context(stage, n).static_bytes` plus the layer inputs in flight, without building the context
    (the same `static_bytes` call and the schedule's in-flight count); `static_only`: without the inputs."""
    o = problem.options
    # several layer kinds: the lightest kind's stage (a bound whatever layers the stage gets)
    static = min(static_bytes(problem.model, problem.parallel, stage, n, o.bytes_per_param, o.precision,
                              o.distributed_optimizer, o.dp_sharding, (k,) * n if problem.heterogeneous else None,
                              o.optimizer_precision)
                 for k in (kinds_present(problem.model) if problem.heterogeneous else ("dense",)))
    if o.vpp > 1 or static_only:  # any split of the n layers over the chunks: static memory does not depend on it
        return static  # in-flight counts differ per chunk: the static part alone is the bound
    in_flight = max(c.in_flight for c in problem.facts.chunks[stage])
    return static + in_flight * problem.graph.input_bytes * (n if per_layer_inputs else 1)


def memory_bound_reason(problem: PlanProblem, method: str, static_only: bool = False) -> str:
    """Why no partition of this layout can fit the budget with `method` ('' when one might); `static_only`: on
    static memory alone, a stage holding at least one layer (a bound for every VPP, split and method of the layout:
    `static_memory_reason`)."""
    pp, layers = problem.parallel.pp, problem.model.num_layers
    vpp = 1 if static_only else problem.options.vpp
    budget = problem.budget_bytes
    per_layer = method not in CHUNKED_METHODS
    cap = layers - pp + 1  # every other stage needs at least one layer
    lo = vpp if vpp > 1 else 1  # layers a stage needs at least (one per chunk)
    even = -(-layers // pp)
    inputs = " + layer inputs in flight" if vpp == 1 and not static_only else ""
    if even >= lo and all(_stage_bytes(problem, s, even, per_layer, static_only) <= budget for s in range(pp)):
        return ""  # the balanced split fits the bound already: no need to look further
    room = 0
    for s in range(pp):
        def fits(k: int, s: int = s) -> bool:
            return k < lo or _stage_bytes(problem, s, k, per_layer, static_only) <= budget

        n = _largest_fitting(fits, cap)
        if n < lo:
            need = _stage_bytes(problem, s, lo, per_layer, static_only)
            return (f"stage {s} needs at least {need / 2**30:.1f} GiB with {lo} layer(s) (static memory{inputs}); "
                    f"budget {budget / 2**30:.1f} GiB")
        room += n
    if room < layers:
        return (f"at most {room} of {layers} layers fit over {pp} stages (static memory{inputs}; budget "
                f"{budget / 2**30:.1f} GiB)")
    return ""


def static_memory_reason(problem: PlanProblem) -> str:
    """Why no candidate of the layout fits on static memory alone, whatever its interleaving, split or method ('' when
    one might): every stage holds its parameters, gradients and optimizer state for at least one layer, and static
    memory depends on the layers a rank holds, not on how they are chunked (`_stage_bytes`). The search refuses a
    whole layout by it before building any of its nodes (`tree.Frontier.static_reason`)."""
    return memory_bound_reason(problem, "block", static_only=True)


def frugal_reason(problem: PlanProblem, partition: Partition) -> str:
    """Why no policy of lynx's fits this partition ('' when one might): Megatron's full recomputation (each layer's
    input kept, everything else recomputed on demand) has the smallest closed-form stage peak of any policy HEU can
    choose (keeping or offloading an op only adds its output to what in-flight micro-batches hold; a layer input
    is never offloaded), and HEU's memory constraint is that peak (`memory.stage_peak_bytes`). Over the budget on a
    stage, nothing fits there; tests/unit/test_search.py plans such candidates anyway."""
    for ctx in problem.stage_contexts(partition):
        graphs = problem.graphs_for(ctx)  # one graph per layer where the model has several kinds
        pol = stage_policy(full_policy, ctx, graphs)
        floor = stage_floor_bytes(layer_memories(graphs, pol.layers), ctx)  # the peak's first terms, no replay
        if floor > ctx.budget_bytes:
            return (f"stage {ctx.stage} needs at least {floor / 2**30:.1f} GiB even recomputing every layer in full "
                    f"(budget {ctx.budget_bytes / 2**30:.1f} GiB)")
        peak = stage_peak_bytes(graphs, pol.layers, ctx)
        if peak > ctx.budget_bytes:
            return (f"stage {ctx.stage} peaks at {peak / 2**30:.1f} GiB even recomputing every layer in full "
                    f"(budget {ctx.budget_bytes / 2**30:.1f} GiB)")
    return ""


def partition_statics(problem: PlanProblem, chunks: tuple[int, ...]) -> tuple[float, ...]:
    """Each rank's static memory on this partition (the layers its virtual stages hold), as `static_bytes` prices it
    for the planner's stage contexts."""
    pp, o = problem.parallel.pp, problem.options
    return tuple(static_bytes(problem.model, problem.parallel, r, sum(chunks[r::pp]), o.bytes_per_param, o.precision,
                              o.distributed_optimizer, o.dp_sharding, _rank_kinds(problem, chunks, r),
                              o.optimizer_precision) for r in range(pp))


def partition_memory_reason(problem: PlanProblem, chunks: tuple[int, ...], method: str,
                            statics: tuple[float, ...] | None = None) -> str:
    """Why no plan of `method` on this partition fits ('' when one might): each rank holds its static memory
    (`statics`, `partition_statics` where not given) and, at the schedule's peak of micro-batches alive per chunk
    (`ScheduleFacts.live`), at least what they keep of each of its layers: the layer inputs (one per chunk of
    Megatron's uniform method), what a method with one fixed layer policy keeps (`rules.fixed_layer_policy`: none,
    full, selective, the module lists, titan-sac), and for mc-offload what stays on the device. `memory.held_bytes`
    sums those over every chunk in flight at the schedule's peak, so this never exceeds the held bytes a plan of the
    method is refused on (`evaluate._held_over_budget`): the candidates it refuses are refused unplanned."""
    pp = problem.parallel.pp
    per_layer = method not in CHUNKED_METHODS
    fixed = None if problem.heterogeneous or not per_layer else fixed_layer_policy(method, problem.graph)
    keeps = layer_memories(problem.graph, (fixed,))[0].retained if fixed is not None else problem.graph.input_bytes
    what = f"what {method} keeps of each layer" if fixed is not None else "layer inputs"
    if method == "mc-offload" and not problem.heterogeneous:
        # every layer keeps everything, and at most its stock modules' inputs leave for the host: what stays per
        # micro-batch in flight (the offloaded bytes count once, `memory.held_bytes`, left out here)
        m = layer_memories(problem.graph, (stock_offload_layer(problem.graph),))[0]
        keeps, what = m.retained - m.offloaded, "what mc-offload keeps on the device of each layer"
    statics = statics if statics is not None else partition_statics(problem, chunks)
    for r in range(pp):
        own = chunks[r::pp]
        per = tuple(keeps * (n if per_layer else 1) for n in own)
        # the schedule's peak of what is alive: every chunk's micro-batches in flight at once, interleaved
        held = max(sum(map(mul, vec, per)) for vec in problem.facts.live[r])
        if statics[r] + held > problem.budget_bytes:
            return (f"stage {r} needs at least {(statics[r] + held) / 2**30:.1f} GiB with its {sum(own)} layers "
                    f"(static memory + {what} in flight); budget {problem.budget_bytes / 2**30:.1f} GiB")
    return ""


def _rank_kinds(problem: PlanProblem, chunks: tuple[int, ...], rank: int) -> tuple[LayerKind, ...] | None:
    """The kinds of the layers rank `rank` holds on this partition (its virtual stages rank, rank + PP, ...),
    None when the model's layers are all of one kind."""
    if not problem.heterogeneous:
        return None
    pp, out = problem.parallel.pp, list[LayerKind]()
    for k in range(rank, len(chunks), pp):
        out += stage_kinds(problem.model, sum(chunks[:k]), chunks[k])
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Pieces:
    """What the time bounds read of a layout: the plain step time of a layer `u`, the embedding's and the LM
    head's forward + backward, the p2p transfer between stages, and the pipeline's shape."""

    u: float
    emb: float
    head: float
    p2p: float
    pp: int
    nmb: int
    layers: int
    fsdp_win: float = 0.0
    """Under FSDP, the idle part of a layer's backward step that hosts its on-demand recomputation
    (`pricing.fsdp_window`, already in `u`); 0 otherwise."""
    above: tuple[float, ...] = ()
    """A model of several layer kinds: prefix sums over the layers in model order of each layer's step beyond `u`
    (`u` is the cheapest kind's; DeepSeek-V3's MoE layers cost more than its dense ones), `layers + 1` entries; empty
    when every layer costs `u`."""

    def work(self, first: int, count: int) -> float:
        """The plain steps of layers first .. first + count - 1."""
        extra = self.above[first + count] - self.above[first] if self.above else 0.0
        return self.u * count + extra

    @property
    def total(self) -> float:
        """Every layer's plain step: what one micro-batch's passes cost on all ranks together, whatever the split."""
        return self.work(0, self.layers)


def pieces(problem: PlanProblem, fsdp: bool = True) -> Pieces:
    """`fsdp`: with FSDP's per-layer terms in `u` (`fsdp_layer_s`); the layout's own problem is needed for them."""
    emb = head = 0.0
    if problem.options.include_edges:  # what the simulator adds to the first and last virtual stage
        et = stage_edge_times(problem.model, problem.hardware, problem.parallel, problem.graph)
        emb, head = et.embedding_fwd + et.embedding_bwd, et.head_fwd + et.head_bwd
    # several layer kinds: `u` is the cheapest kind's layer time (a lower bound for any layer), and each layer's
    # own step is kept as its excess over it (the terms that count every layer, or a known split's, read those)
    sw, layers = problem.options.subtract_wgrad, problem.model.num_layers
    above: tuple[float, ...] = ()
    if problem.heterogeneous:
        steps: dict[str, float] = {k: g.step_time(sw) for k, g in problem.kind_graphs}
        u = min(steps.values())
        above = _excess_sums(problem, steps, u)
    else:
        u = problem.graph.step_time(sw)
    exposed, win = fsdp_layer_s(problem) if fsdp else (0.0, 0.0)
    return Pieces(u + exposed + win, emb, head, p2p_seconds(problem),
                  problem.parallel.pp, problem.parallel.num_microbatches, layers, win, above)


def method_pieces(problem: PlanProblem, method: str, p: Pieces) -> Pieces | None:
    """`p` with every layer's step lengthened by the on-demand recomputation the stock method's fixed layer policy
    places in it (`rules.fixed_layer_policy`: none, full, selective, the dense module lists) beyond what an FSDP
    window hides: the simulator charges it before the layer's backward (`cost.pricing.layer_recompute`; Megatron's
    recompute is on demand, no window hosts it). A model of several kinds: each layer its kind's policy, as the
    stock methods apply them (`methods.common.stage_policy`). None where the method has no fixed policy (block,
    uniform, the MoE module lists) or recomputes nothing on demand."""
    def demand(g: LayerGraph) -> float | None:
        lp = fixed_layer_policy(method, g)
        return None if lp is None else layer_recompute(g, lp, (0.0, 0.0), top=True).on_demand

    if not problem.heterogeneous:
        d = demand(problem.graph)
        extra = 0.0 if d is None else max(0.0, d - p.fsdp_win)
        return replace(p, u=p.u + extra) if extra > 0 else None
    sw = problem.options.subtract_wgrad
    steps: dict[str, float] = {}
    recomputes = False
    for k, g in problem.kind_graphs:
        d = demand(g)
        if d is None:
            return None
        steps[k] = g.step_time(sw) + d
        recomputes = recomputes or d > 0
    if not recomputes:
        return None
    u = min(steps.values())
    return replace(p, u=u, above=_excess_sums(problem, steps, u))


def _excess_sums(problem: PlanProblem, steps: dict[str, float], u: float) -> tuple[float, ...]:
    """`Pieces.above`: prefix sums over the model's layers of their kind's step (`steps`) beyond `u`."""
    return tuple(accumulate((steps[k] - u for k in problem.range_kinds(0, problem.model.num_layers)), initial=0.0))


def fsdp_layer_s(problem: PlanProblem) -> tuple[float, float]:
    """What FSDP adds to every layer's step whatever its policy, as `cost.stage.chunk_costs` charges it: (the
    forward's wait for the layer's gather beyond its compute, the backward's window `pricing.fsdp_window`), the
    smallest over the stages; (0, 0) without FSDP or for a model of several layer kinds."""
    if problem.heterogeneous:
        return 0.0, 0.0
    g = problem.graph
    fwd = g.fwd_time()
    bwd = sum(o.bwd_time for o in g.ops if not o.is_comm) + g.exposed_bwd_comm(problem.options.subtract_wgrad)
    charges = [c for c in (problem.fsdp_charge(s) for s in range(problem.parallel.pp)) if c is not None]
    if not charges:
        return 0.0, 0.0
    return (min(max(0.0, c.gather_fwd_s - fwd) for c in charges),
            min(max(0.0, c.gather_bwd_s + c.reduce_s - bwd) for c in charges))


def _chain(p: Pieces, virtual_stages: int) -> float:
    """One micro-batch's forward and backward through every virtual stage, a p2p transfer between each."""
    return p.emb + p.head + p.total + 2 * (virtual_stages - 1) * p.p2p


def _fixed(p: Pieces, r: int) -> float:
    """Rank r's time outside its layers: the embedding's start-up and drain before and after it (r > 0), 2 r p2p
    transfers, and the edges it runs for every micro-batch."""
    return ((p.emb if r > 0 else 0.0) + 2 * r * p.p2p
            + p.nmb * ((p.emb if r == 0 else 0.0) + (p.head if r == p.pp - 1 else 0.0)))


def step_s(problem: PlanProblem, rank: int, layers: int, kinds: tuple[LayerKind, ...] | None = None) -> float:
    """The rank's optimizer step and passes over its gradient buffer, after its last backward (the simulator's
    tail, `simulate.metrics.tail_time`, less the exposed DP collective it may add); under FSDP or a partial
    distributed optimizer the step over the rank's shard, as the tail charges it."""
    o = problem.options
    if not o.include_dp_allreduce:
        return 0.0
    hw = device_hardware(problem.hardware, problem.graph)
    device, recipe = hw.device, problem.static_recipe
    sharding = problem.dp_sharding
    if sharding is not None:  # FSDP (or a partial distributed optimizer): its step on the shard, as the tail charges
        return fsdp_step_time(problem.model, hw, problem.parallel, rank, layers, recipe, sharding)
    return (optimizer_step_time(problem.model, problem.parallel, rank, layers, recipe, device, o.distributed_optimizer,
                                kinds, hw.host(), hw.devices_per_node)
            + grad_buffer_time(problem.model, problem.parallel, rank, layers, recipe, device, o.check_for_nan_in_grad,
                               o.ddp_average_in_collective, kinds))


def partition_time_bound_s(problem: PlanProblem, chunks: tuple[int, ...], p: Pieces | None = None,
                           step: Callable[[int, int, tuple[LayerKind, ...] | None], float] | None = None,
                           extra: tuple[float, ...] = ()) -> float:
    """A lower bound on the iteration time of any plan on this partition (`chunks`: layers per virtual stage in
    model order, virtual stage k on rank k % PP): the start-up and drain bound per rank, one micro-batch's chain,
    and each rank's own work followed by its optimizer step. `p` and `step` (rank, layers, the rank's layer kinds
    -> `step_s`): the problem's pieces and step time where the caller keeps them (they do not depend on the split
    flags). `extra`: per rank, seconds every micro-batch's pass adds beyond its layers' steps (a known policy's
    on-demand recomputation, `policy_extra_s`): in the rank's own work and in the chain."""
    p = pieces(problem) if p is None else p
    after = step or (lambda r, n, k: step_s(problem, r, n, k))
    ex = extra or (0.0,) * p.pp
    starts = list(accumulate(chunks, initial=0))
    own = [p.nmb * (sum(p.work(starts[k], chunks[k]) for k in range(r, len(chunks), p.pp)) + ex[r])
           for r in range(p.pp)]
    ranks = [_fixed(p, r) + p.work(0, starts[r]) + own[r] for r in range(p.pp)]
    edges = [p.nmb * ((p.emb if r == 0 else 0.0) + (p.head if r == p.pp - 1 else 0.0)) for r in range(p.pp)]
    steps = [own[r] + edges[r] + after(r, sum(chunks[r::p.pp]), _rank_kinds(problem, chunks, r))
             for r in range(p.pp)]
    return SAFETY * max(max(ranks), max(steps), _chain(p, len(chunks)) + sum(ex))


def policy_extra_s(problem: PlanProblem, result: PlanResult, p: Pieces) -> tuple[float, ...]:
    """Per rank, the on-demand recomputation one micro-batch's backward charges on the critical path under the
    result's policies beyond what FSDP's window hides (`cost.pricing.layer_recompute`: on-demand work, and the
    Megatron re-runs, before each layer's backward; at least `max(0, demand - window)` with the smallest window
    of the stages, `Pieces.fsdp_win`, already in `u`). Counts on-demand work only: what a policy places in the
    windows (phases 1-4, lynx's) may hide. For stock Megatron policies that is all their recomputation; models of
    several layer kinds get zeros."""
    if problem.heterogeneous:
        return (0.0,) * len(result.policies)
    g, win = problem.graph, p.fsdp_win
    seen: dict[int, float] = {}
    out = []
    for pol in result.policies:
        total = 0.0
        for lp in pol.layers:
            d = seen.get(id(lp))
            if d is None:
                d = seen[id(lp)] = max(0.0, recompute_time(g, lp, (Phase.ON_DEMAND,)) - win)
            total += d
        out.append(total)
    return tuple(out)


def _pipeline_any(p: Pieces) -> float:
    """A lower bound on min over splits of max_k (fixed_k + the steps of the layers before k + micro-batches x the
    steps of the layers on k), in closed form: the average of the stages' terms weighted w_k = (1 -
    1/micro-batches)^(PP - 1 - k) is (micro-batches x every layer's step + sum_k w_k fixed_k) / sum_k w_k whatever
    the split (layer l's coefficients sum to micro-batches x its step u_l on whichever stage it lies: the layers'
    kinds may differ), and a maximum is at least any weighted average."""
    r = 1.0 - 1.0 / p.nmb
    w = [r ** (p.pp - 1 - k) for k in range(p.pp)]
    return (p.nmb * p.total + sum(wk * _fixed(p, k) for k, wk in enumerate(w))) / sum(w)


def time_bound_from(p: Pieces, vpp: int) -> float:
    """A lower bound on the iteration time of any plan of a layout (any method, any partition) with `vpp` chunks
    per rank: with interleaving, min over per-rank layer counts N_r >= VPP of max_r (fixed_r + r u + micro-batches
    x u x N_r) (a layer per earlier virtual stage) by its continuous relaxation (the average rank, and the rank with
    the most fixed time holding VPP layers); in 1F1B, `_pipeline_any` and a layer on every stage. Where the layers'
    kinds differ, `u` is the cheapest kind's step and the average rank and the chain count each layer's own
    (`Pieces.total`)."""
    a = p.nmb * p.u
    if vpp > 1:
        c = [_fixed(p, r) + r * p.u for r in range(p.pp)]
        return SAFETY * max((p.nmb * p.total + sum(c)) / p.pp, max(c) + a * vpp, _chain(p, p.pp * vpp))
    ends = max(_fixed(p, k) + p.u * k + a for k in range(p.pp))
    return SAFETY * max(_pipeline_any(p), ends, _chain(p, p.pp))


def plain_s(problem: PlanProblem, partition: Partition) -> float:
    """A lower bound on the simulated iteration time of any policy on `partition` (`methods.common.plain_time`). One
    simulation: the search spends it on a lynx interleaved node whose cheaper bounds did not prune it, before
    Lynx-HEU's stage problems (tens of MILPs) are solved for it (`tree.Frontier.tighten`)."""
    return SAFETY * plain_time(problem, partition)


def time_bound_s(problem: PlanProblem) -> float:
    """`time_bound_from` of the problem's layout."""
    return time_bound_from(pieces(problem), problem.options.vpp)
