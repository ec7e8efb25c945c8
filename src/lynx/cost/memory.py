"""Memory model: static memory per stage, and the activation memory a layer policy implies.

The closed form here (``stage_peak_bytes``) is what solvers constrain; the event simulator
(`lynx.simulate`) recomputes memory event by event and is the judge of whether a plan fits.
See docs/costmodel.md for every term.
"""

from __future__ import annotations

from dataclasses import dataclass

from lynx.cost.fsdp import DpSharding
from lynx.cost.lifetime import backward_trace
from lynx.cost.static_memory import OptimizerPrecision
from lynx.decisions import BWD_PHASES, FWD_PHASES, LayerPolicy, Phase, StageContext
from lynx.families import get_family
from lynx.graph import Graphs, LayerGraph, per_graph, per_layer, slice_graphs
from lynx.spec import ModelSpec, ParallelSpec
from lynx.stack import LayerKind

DEFAULT_BYTES_PER_PARAM = 16.0
"""fp16 params (2) + fp16 grads (2) + fp32 master params, momentum, variance (4 + 4 + 4): the paper's
16n, from ZeRO (Rajbhandari et al. 2020, sec. 3.1). Use 18 for bf16 params with fp32 gradients."""


def layer_params_per_rank(model: ModelSpec, tp: int) -> float:
    """One layer's parameters on one TP rank (the model family's count: `lynx.families`)."""
    return get_family(model.family).layer_params(model, tp)


def embedding_params_per_rank(model: ModelSpec, tp: int) -> float:
    """The first stage's embeddings on one TP rank (the model family's count)."""
    return get_family(model.family).embedding_params(model, tp)


def static_bytes(
    model: ModelSpec, par: ParallelSpec, stage: int, num_layers: int,
    bytes_per_param: float | None = None, precision: str = "paper",
    distributed_optimizer: bool = False, dp_sharding: DpSharding | None = None,
    kinds: tuple[LayerKind, ...] | None = None, optimizer: OptimizerPrecision | None = None,
    step_only: bool = False,
) -> float:
    """Parameters, gradients and optimizer states of one stage on one device (`lynx.cost.static_memory`:
    embeddings on the first stage, the LM head copy and final LayerNorm on the last, recipes, sharding;
    FSDP and a partial distributed optimizer: `lynx.cost.fsdp.sharded_static`), as forward and backward see them.
    `step_only`: instead, what only the optimizer step holds beside them (`StaticBreakdown.step_bytes`: the fp16
    recipe's fp32 main-gradient copy; 0 under FSDP, a partial distributed optimizer or torchtitan's FSDP2, which
    are priced whole)."""
    from lynx.cost.fsdp import running_sharding, sharded_static
    from lynx.cost.static_memory import recipe_for, stage_static
    from lynx.families import get_family

    if dp_sharding is not None and (dp_sharding.fsdp or dp_sharding.instances > 1):
        ds = running_sharding(model, dp_sharding, par, distributed_optimizer)
        if ds is not None:
            if step_only:
                return 0.0
            recipe = recipe_for(precision, bytes_per_param, optimizer)
            return sharded_static(model, par, stage, num_layers, recipe, ds, bytes_per_param).total
    if get_family(model.family).static_memory == "torchtitan-fsdp":  # torchtitan's FSDP2 as it runs
        from lynx.cost.titan_fsdp import titan_static_bytes

        return 0.0 if step_only else titan_static_bytes(model, par, stage, num_layers, bytes_per_param, precision,
                                                        distributed_optimizer)
    recipe = recipe_for(precision, bytes_per_param, optimizer)
    st = stage_static(model, par, stage, num_layers, recipe, distributed_optimizer, kinds)
    return st.step_bytes if step_only else st.total


def extra_retained_bytes(model: ModelSpec, par: ParallelSpec, stage: int) -> float:
    """Per micro-batch outside the layers: the embedding dropout mask on the first stage (Korthikanti
    et al. 2022, sec. 4.3: sbhp/t with p the number of stages counted on stage 0)."""
    if stage != 0 or not model.dropout or model.hidden_dropout == 0:
        return 0.0
    sbh = par.seq_length // par.cp * par.micro_batch_size * model.hidden_size  # s / CP tokens per rank
    return sbh / (par.tp if par.sequence_parallel else 1)


def extra_transient_bytes(model: ModelSpec, par: ParallelSpec, stage: int) -> float:
    """Working memory outside the layers: on the last stage the logits in 16 bits plus their fp32 copy
    for the cross-entropy, 4sbv/t in Korthikanti et al. 2022 sec. 4.3 (we count 2 + 4 bytes)."""
    if stage != par.pp - 1:
        return 0.0
    return 6.0 * (par.seq_length // par.cp) * par.micro_batch_size * model.vocab_size / par.tp


def mtp_bytes(model: ModelSpec, par: ParallelSpec, stage: int, graph: LayerGraph) -> float:
    """DeepSeek-V3's multi-token-prediction layers on the last stage, held from their forward to their backward
    for one micro-batch (they run after the stage's last layer, and its backward follows at once): per MTP layer a
    transformer layer of the model's primary kind keeping every activation (`graph`), the [tok, 2h] concatenation
    its projection reads and the h-wide projection output, and its own logits (the `extra_transient_bytes`
    6 s b V / t again: the MTP loss is computed beside the main one, both saved for backward)."""
    if stage != par.pp - 1 or not model.mtp_num_layers:
        return 0.0
    keep = layer_memories(graph, (LayerPolicy(graph.needed()),))[0].retained
    tok = (par.seq_length // par.cp) * par.micro_batch_size
    tok_ln = tok / par.tp if par.sequence_parallel else tok
    proj = 2.0 * (2 * tok_ln + tok_ln) * model.hidden_size
    return model.mtp_num_layers * (keep + proj + extra_transient_bytes(model, par, stage))


def grad_workspace_bytes(graph: Graphs) -> float:
    """Gradient buffers alive during one op's backward: the incoming and outgoing gradients of the largest
    activation (an upper bound on what the autograd engine holds at once inside a layer; of any kind's layer)."""
    gs = (graph,) if isinstance(graph, LayerGraph) else graph
    return 2.0 * max((o.out_bytes for g in gs for o in g.ops), default=0.0)


@dataclass(frozen=True, slots=True)
class LayerMemory:
    """The memory a layer policy implies, per micro-batch, in bytes."""

    retained: float
    """Held from the layer's forward until its backward (the input and every kept op)."""
    fwd_window: float
    """Recomputed in phases 1, 2 (a later forward) and held until this layer's backward."""
    bwd_window: float
    """Recomputed in phases 3, 4, during the backward of the layer above."""
    on_demand: float
    """Recomputed right before this layer's backward."""
    dropped: float
    """Produced in forward and freed at once (alive while the layer's forward runs)."""
    offloaded: float = 0.0
    """The part of `retained` that is offloaded (`LayerPolicy.offload`): on the device only for the micro-batch
    being copied out or reloaded (docs/offload.md), on the host for the others."""


@per_graph
def layer_memory(graph: LayerGraph, lp: LayerPolicy) -> LayerMemory:
    keep = set(lp.keep)

    def sum_phase(phases: tuple[Phase, ...]) -> float:
        return sum(graph.keep_bytes(n) for n in lp.recomputed(phases))

    # A re-run op (`LayerPolicy.rerun`) keeps its output but not its side state, which its re-run rebuilds
    # together with a fresh output right before its backward.
    rerun_side = sum(graph.op(n).mask_bytes for n in lp.rerun)
    rerun_work = sum(graph.op(n).out_bytes + graph.op(n).mask_bytes for n in lp.rerun)
    retained = graph.retained_bytes(keep) - rerun_side - (0.0 if lp.input_checkpoint else graph.input_bytes)
    return LayerMemory(
        retained=retained,
        fwd_window=sum_phase(FWD_PHASES),
        bwd_window=sum_phase(BWD_PHASES),
        on_demand=sum_phase((Phase.ON_DEMAND,)) + rerun_work,
        dropped=graph.full_activation_bytes() - retained,
        offloaded=sum(graph.keep_bytes(n) for n in lp.offload),
    )


def fixed_bytes(ctx: StageContext, num_layers: int, input_bytes: float) -> float:
    """Memory of a stage that no recomputation decision changes: static, non-layer terms, and the layer
    inputs (always stored) of every in-flight micro-batch. OPT's memory rows and replay start from it."""
    if not ctx.chunk_layers:
        return (ctx.static_bytes + ctx.extra_transient_bytes + ctx.grad_workspace_bytes
                + ctx.in_flight * (ctx.extra_retained_bytes + num_layers * input_bytes))
    return (ctx.static_bytes + ctx.extra_transient_bytes + ctx.grad_workspace_bytes
            + ctx.extra_in_flight * ctx.extra_retained_bytes + ctx.layer_microbatches() * input_bytes)


def held_bytes(mems: list[LayerMemory], ctx: StageContext) -> float:
    """Activations the stage holds for backward at its peak: each chunk's in-flight micro-batches times
    its layers' retained bytes, plus the non-layer retained bytes (the schedule's facts give the counts).
    Offloaded bytes count once per chunk (one micro-batch on the device: the one being copied out, or the one
    reloaded for its backward; docs/offload.md) instead of once per micro-batch in flight."""
    off = [sum(m.offloaded for m in mems[lo:hi]) for lo, hi in ctx.chunk_slices()]
    if not ctx.chunk_layers:
        if not off[0]:  # bit-identical to the figure before offloading existed
            return ctx.in_flight * (sum(m.retained for m in mems) + ctx.extra_retained_bytes)
        return (ctx.in_flight * (sum(m.retained - m.offloaded for m in mems) + ctx.extra_retained_bytes)
                + min(ctx.in_flight, 1) * off[0])
    per_chunk = [sum(m.retained - m.offloaded for m in mems[lo:hi]) if o else sum(m.retained for m in mems[lo:hi])
                 for (lo, hi), o in zip(ctx.chunk_slices(), off, strict=True)]
    per_chunk[0] += ctx.extra_retained_bytes  # the first virtual stage's embedding mask
    return ctx.peak_weighted(tuple(per_chunk)) + sum(off)


def host_bytes(mems: list[LayerMemory], ctx: StageContext) -> float:
    """Host memory one GPU of the stage pins for offloaded activations: every in-flight micro-batch's offloaded
    bytes (an upper bound: the micro-batch on the device may still have its copy on the host)."""
    off = tuple(sum(m.offloaded for m in mems[lo:hi]) for lo, hi in ctx.chunk_slices())
    if not ctx.chunk_layers:
        return ctx.in_flight * off[0]
    return ctx.peak_weighted(off)


def layer_memories(graph: Graphs, layers: tuple[LayerPolicy, ...]) -> list[LayerMemory]:
    """`layer_memory` of each layer with its own graph, computed once per distinct (graph, policy) object pair: a
    stage's layers share a handful of policy objects (`(lp,) * n`), and `layer_memory` is a pure function of both
    (both frozen; the pairs are alive for the call, so their ids are unique)."""
    seen: dict[tuple[int, int], LayerMemory] = {}
    out = []
    for g, lp in zip(per_layer(graph, len(layers)), layers, strict=True):
        key = (id(g), id(lp))
        m = seen.get(key)
        if m is None:
            m = seen[key] = layer_memory(g, lp)
        out.append(m)
    return out


def linear_peak_bytes(graph: Graphs, layers: tuple[LayerPolicy, ...], ctx: StageContext) -> float:
    """The linear form HEU's memory rows and OPT's M5 constrain: `stage_peak_bytes` with the forward-window
    holdings and the backward working set replaced by sums of `keep_bytes` (phase-1/2 ops; per layer
    on_demand(l) + bwd_window(l) + bwd_window(l - 1), plus phase 1/2 without forward windows). An upper bound
    of `stage_peak_bytes` for policies whose layers all checkpoint their input (docs/concepts/memory.md, "The
    solvers"; property-tested); uniform chunks are outside it."""
    gs = per_layer(graph, len(layers))
    mems = layer_memories(gs, layers)
    held_fwd = sum(m.fwd_window for m in mems) if ctx.has_fwd_windows else 0.0
    bwd_phases = BWD_PHASES + (Phase.ON_DEMAND,) + (() if ctx.has_fwd_windows else FWD_PHASES)
    work_b = 0.0
    for i, m in enumerate(mems):
        below = mems[i - 1].bwd_window if i > 0 else 0.0
        own = m.on_demand + m.bwd_window + (0.0 if ctx.has_fwd_windows else m.fwd_window)
        out = (restored_output_bytes(gs[i], layers[i], bwd_phases)
               + (restored_output_bytes(gs[i - 1], layers[i - 1], BWD_PHASES) if i > 0 else 0.0))
        work_b = max(work_b, own + below + out)
    work_f = max((m.dropped for m in mems), default=0.0)
    if ctx.has_fwd_windows:  # a layer output rebuilt in a forward window, beside that forward's working set
        work_f += max((restored_output_bytes(g, lp, FWD_PHASES) for g, lp in zip(gs, layers, strict=True)),
                      default=0.0)
    return (ctx.static_bytes + ctx.extra_transient_bytes + ctx.grad_workspace_bytes
            + held_bytes(mems, ctx) + held_fwd + max(work_f, work_b))


def restored_output_bytes(graph: LayerGraph, lp: LayerPolicy, phases: tuple[Phase, ...]) -> float:
    """The layer output's bytes when `lp` recomputes the output op in one of `phases`, else 0: `keep_bytes`
    counts only its mask (the output is the next layer's input, counted there), but while the restoration runs
    the rebuilt output exists beside it (`lynx.cost.lifetime`'s transient sample). HEU's rows and OPT's M5 add the
    same term (R_out x out_bytes) so that they bound the replay."""
    out = graph.output_op
    return graph.op(out).out_bytes if any(n == out and p in phases for n, p in lp.recompute) else 0.0


def stage_lifetimes(graph: Graphs, layers: tuple[LayerPolicy, ...], ctx: StageContext
                    ) -> tuple[float, float, float]:
    """(forward-window holdings of one micro-batch, backward working set, forward-window transient) from the
    activation-lifetime replay (`lynx.cost.lifetime`), each chunk of an interleaved stage on its own. The
    transient is what the phase-1/2 restores hold beyond their holdings while they run in a later forward;
    it adds to that forward's own working set."""
    slices = ctx.chunk_slices() if ctx.chunk_layers else ((0, len(layers)),)
    held_fwd, work_b, fwd_tr = 0.0, 0.0, 0.0
    for lo, hi in slices:
        tr = backward_trace(slice_graphs(graph, lo, hi), layers[lo:hi], ctx.has_fwd_windows)
        held_fwd += sum(tr.fwd_held) if ctx.has_fwd_windows else 0.0
        fwd_tr = max(fwd_tr, tr.fwd_transient if ctx.has_fwd_windows else 0.0)
        # one chunk: the pass's micro-batch is among the in-flight ones counted, so layers above release theirs
        work_b = max(work_b, tr.restored_peak if ctx.chunk_layers else tr.peak)
    return held_fwd, work_b, fwd_tr


def stage_peak_bytes(graph: Graphs, layers: tuple[LayerPolicy, ...], ctx: StageContext) -> float:
    """Closed-form peak of a stage (an upper bound the simulator confirms):

    static + extra + sum over chunks of in_flight(chunk) * (sum of its layers' retained)
           + (forward-window holdings) + max(forward working set, backward working set) + gradient workspace

    forward working set  = max over layers of the outputs a layer produces and drops, plus what a
                           forward window's restores hold at once beyond their holdings;
    backward working set = the largest total one micro-batch's backward restores at once (a restoration's
                           output beside its inputs, before they are freed), from the
    activation-lifetime replay (`lynx.cost.lifetime`: restored outputs freed once no pending backward or
    recomputation reads them; a uniform chunk restores all its layers; phase-3/4 restores of layer l - 1
    during layer l's backward); forward-window holdings = what the phase-1/2 restores leave alive.
    With one chunk, in_flight is the schedule's min(p - s, m) for 1F1B.
    """
    mems = layer_memories(graph, layers)
    held_fwd, work_b, fwd_tr = stage_lifetimes(graph, layers, ctx)
    work_f = max((m.dropped for m in mems), default=0.0)
    # the optimizer step's own allocation (`StageContext.step_bytes`) comes when no activation is alive
    peak = stage_floor_bytes(mems, ctx) + held_fwd + max(work_f + fwd_tr, work_b)
    return max(peak, ctx.static_bytes + ctx.step_bytes)


def stage_floor_bytes(mems: list[LayerMemory], ctx: StageContext) -> float:
    """The first terms of `stage_peak_bytes` (static, non-layer and gradient workspace, and what the in-flight
    micro-batches hold), without the activation-lifetime replay. `stage_peak_bytes` adds two terms to this very
    float: the forward holdings (a sum of byte counts) and max(forward set, backward set), at least the backward
    set, which is >= 0 wherever the replay's pass starts from what it holds (no phase-1/2 restore changed a lower
    layer after its holdings were taken: always for Megatron's rules, which restore on demand only); IEEE
    addition of a non-negative term never decreases a sum, so there `stage_floor_bytes(...) > budget` implies
    `stage_peak_bytes(...) > budget` bit for bit (`methods.rules.plan_block` skips the replay on it;
    tests/unit/test_memory_floor.py)."""
    return ctx.static_bytes + ctx.extra_transient_bytes + ctx.grad_workspace_bytes + held_bytes(mems, ctx)


def predicted_activation_bytes(graph: Graphs, layers: tuple[LayerPolicy, ...], extra_per_layer: list[float],
                               in_flight: int, fwd_windows: bool,
                               extra_per_op: dict[str, float] | None = None,
                               transient: bool = False) -> tuple[float, float]:
    """What a runtime stage holds for backward: (after the forwards in flight, peak including what backward
    restores). The same terms as `stage_peak_bytes` without static and non-layer memory; `extra_per_layer`
    adds bytes the runtime holds per layer for its kept ops beyond the graph (e.g. LayerNorm statistics),
    `extra_per_op` the same bytes per op for restored ones. By default the recompute engine's byte ledger
    (sampled after a restoration's frees); `transient=True`: the allocator's view, each restoration's output
    beside its inputs (`lynx.cost.lifetime`). `graph`: one graph, or one per layer (a stack of several kinds)."""
    mems = layer_memories(graph, layers)
    retained = sum(m.retained for m in mems) + sum(extra_per_layer)
    tr = backward_trace(graph, layers, fwd_windows, extra_per_op, transient)
    held_fwd = sum(tr.fwd_held) if fwd_windows else 0.0
    after_fwd = in_flight * retained + held_fwd
    return after_fwd, after_fwd + tr.peak
