"""How Lynx-HEU prices a stage policy, the way the simulator charges it: critical recomputation per
micro-batch (phase 5, window overflow, each chunk's top layer's phases 3/4, the cool-down share of phases
1/2), and the window capacities CTime_t of eq. (5). Used by the HEU model (`lynx.policy.heu`) and by
whoever compares policies."""

from __future__ import annotations

from lynx.cost.pricing import bwd_windows, fsdp_window, fwd_windows, layer_recompute
from lynx.cost.pricing import recompute_time as recompute_time
from lynx.decisions import LayerPolicy, Phase, StageContext
from lynx.graph import Graphs, LayerGraph, per_layer


def cooldown_weight(ctx: StageContext, cooldown_overlap: bool) -> float:
    """Share of micro-batches whose backward has no forward before it (cool-down) on this stage; their
    phase-1/2 work is on demand unless hidden in a stall."""
    if cooldown_overlap or not ctx.has_fwd_windows:
        return 0.0
    return ctx.cooldown_count / max(1, ctx.num_microbatches)


def critical_recompute(graph: Graphs, layers: tuple[LayerPolicy, ...], ctx: StageContext,
                       cooldown_overlap: bool = True) -> float:
    """On-critical-path recomputation per micro-batch of a stage policy, priced as the simulator prices it:
    phase 5, window overflow, the top layer's phase 3/4 (a layer's phase 3/4 in the windows of the layer above),
    and (without cool-down overlap) the cool-down share of phase 1/2. The HEU objective without its tie-break
    term."""
    gs = per_layer(graph, len(layers))
    wins = {id(g): (fwd_windows(g), bwd_windows(g, ctx.subtract_wgrad), fsdp_window(g, ctx)) for g in gs}
    lam = cooldown_weight(ctx, cooldown_overlap)
    tops = {hi - 1 for _, hi in ctx.chunk_slices()} if ctx.chunk_layers else {len(layers) - 1}
    total = 0.0
    for i, lp in enumerate(layers):
        win_f = wins[id(gs[i])][0]
        win_b = wins[id(gs[i + 1] if i + 1 < len(gs) else gs[i])][1]
        r = layer_recompute(gs[i], lp, win_b, top=i in tops, fsdp_win=wins[id(gs[i])][2])
        total += r.on_demand
        for k, load in enumerate(r.fwd_loads):
            total += max(0.0, load - win_f[k]) + lam * min(load, win_f[k])
    return total


def window_caps(graph: LayerGraph, subtract_wgrad: bool) -> dict[Phase, float]:
    """CTime_t of eq. (5): idle time of the four windows; backward ones are comm - wgrad when Megatron
    already overlaps the weight-gradient GEMM with the collective (ctx.subtract_wgrad)."""
    (wf_attn, wf_mlp), (wb_mlp, wb_attn) = fwd_windows(graph), bwd_windows(graph, subtract_wgrad)
    return {Phase.FWD_ATTN: wf_attn, Phase.FWD_MLP: wf_mlp, Phase.BWD_MLP: wb_mlp, Phase.BWD_ATTN: wb_attn}
