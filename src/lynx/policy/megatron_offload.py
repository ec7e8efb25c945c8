"""Megatron-Core's fine-grained activation offloading as a baseline (docs/offload.md), and the mapping from lynx's
per-op offload choices back to its modules (the export).

Megatron's semantics (megatron/core/transformer/transformer_config.py ``fine_grained_activation_offloading``,
``offload_modules``; megatron/core/pipeline_parallel/fine_grained_activation_offload.py): each listed module
offloads its *input* on a D2H stream after the forward and reloads it on an H2D stream before its backward.
Dense-model modules: ``attn_norm`` (the layer input), ``qkv_linear`` (the first norm's output), ``core_attn``
(Q, K, V), ``attn_proj`` (the attention output), ``mlp_norm`` (the residual after attention); ``expert_fc1`` and
``moe_act`` exist only in MoE layers, so the dense MLP's activations cannot be offloaded. After a warm-up step
(the versions after 0.16.1 that have the two knobs below) it fixes which groups (one per module and layer) go
out: the last group of each module stays on the device (the "offload margin": its reload would block the
compute stream), rank r keeps ``r * --delta-offload-bytes-across-pp-ranks`` bytes on the device by disabling
groups from the front, and ``--activation-offload-fraction`` disables the last ``1 - fraction`` of the remaining
groups in forward order.

lynx always stores the layer input (its checkpoint), so ``attn_norm`` is not modelled: the baseline keeps the
layer input on the device (Megatron would offload it too; listed in the method's notes).
"""

from __future__ import annotations

from lynx.decisions import LayerPolicy, RecomputePolicy, StageContext
from lynx.graph import LAYER_INPUT, LayerGraph, per_graph
from lynx.policy.rules import keep_all

OFFLOAD_MODULES: tuple[str, ...] = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1",
                                     "moe_act")
"""Megatron-Core's ``--offload-modules`` choices, in forward order (``expert_fc1``: the routed experts' input,
``moe_act``: their activation's input; MoE layers only)."""
STOCK_MODULES: tuple[str, ...] = OFFLOAD_MODULES
"""The stock setting the baseline prices: every module, fraction 1, no PP delta (a dense graph has no expert
ops, so the MoE modules select nothing there)."""


@per_graph
def module_offload_ops(graph: LayerGraph, module: str) -> tuple[str, ...]:
    """The lynx ops whose outputs Megatron's `module` offloads (its input tensors), forward order; () for
    attn_norm (the layer input, always stored by lynx) or a module the graph lacks."""
    names = set(graph.names)
    needed = graph.needed()
    norms = graph.module_ops("layernorm")
    out: list[str] = []
    if module == "qkv_linear" and "qkv" in names:
        out = list(graph.op("qkv").saved)
    elif module == "core_attn":
        inside = set(graph.module_ops("core_attn"))
        out = [s for n in graph.module_ops("core_attn") for s in graph.op(n).saved if s not in inside]
    elif module == "attn_proj" and "attn_proj" in names:
        out = list(graph.op("attn_proj").saved)
    elif module == "mlp_norm":  # the norm reading the attention residual (MLA and QK norms are "layernorm" too)
        out = [s for n in norms if "attn_residual" in graph.op(n).inputs for s in graph.op(n).saved]
    elif module == "expert_fc1" and "experts_fc1" in names:
        out = list(graph.op("experts_fc1").saved)
    elif module == "moe_act" and "experts_act" in names:
        out = list(graph.op("experts_act").saved)
    return tuple(dict.fromkeys(n for n in out if n != LAYER_INPUT and n in needed))


def ops_to_modules(graph: LayerGraph, ops: frozenset[str]) -> tuple[tuple[str, ...], frozenset[str]]:
    """(Megatron modules whose every offloaded input is in `ops`, the ops no such module covers)."""
    mods, covered = [], set()
    for m in OFFLOAD_MODULES:
        mo = set(module_offload_ops(graph, m))
        if mo and mo <= ops:
            mods.append(m)
            covered |= mo
    if "attn_proj" in mods and "core_attn" not in mods:  # Megatron refuses attn_proj alone (config check)
        if not module_offload_ops(graph, "core_attn"):  # its inputs are inside it here (CP a2a): listing it moves
            mods.insert(mods.index("attn_proj"), "core_attn")  # nothing more, as mc-offload's own policy has it
        else:
            mods.remove("attn_proj")
            covered -= set(module_offload_ops(graph, "attn_proj")) - set(module_offload_ops(graph, "core_attn"))
    return tuple(mods), frozenset(ops - covered)


def megatron_offload_policy(ctx: StageContext, graph: LayerGraph, modules: tuple[str, ...] = STOCK_MODULES,
                            fraction: float = 1.0, delta_bytes: float = 0.0) -> RecomputePolicy:
    """Every layer keeps everything (no recomputation) and offloads what Megatron's modules pick on this stage
    (module docstring: margin, PP delta, fraction)."""
    return _offload_policy(graph, ctx.num_layers, modules, fraction, ctx.stage * delta_bytes)


@per_graph
def _offload_policy(graph: LayerGraph, num_layers: int, modules: tuple[str, ...], fraction: float,
                    keep_dev: float) -> RecomputePolicy:
    """`megatron_offload_policy` of a stage of `num_layers` layers keeping `keep_dev` bytes on the device (all it
    reads of the stage; a search asks it of every stage of thousands of candidates)."""
    per_module = {m: module_offload_ops(graph, m) for m in modules}
    groups = [(li, m, per_module[m]) for li in range(num_layers) for m in modules]
    groups = [g for g in groups if g[2]]
    last = {m: li for li, m, _ in groups}  # each module's last layer (groups run in layer order)
    on = [g for g in groups if g[0] != last[g[1]]]  # the offload margin
    while on and keep_dev > 0:  # the PP delta, from the front
        keep_dev -= sum(graph.keep_bytes(n) for n in on[0][2])
        on.pop(0)
    drop = int(len(on) * (1.0 - fraction))  # the fraction, from the back
    on = on[:len(on) - drop]
    base = keep_all(graph)
    per_layer: list[set[str]] = [set() for _ in range(num_layers)]
    for li, _, ops in on:
        per_layer[li] |= set(ops)
    layers = tuple(LayerPolicy(base.keep, base.recompute, offload=frozenset(s) & base.keep) for s in per_layer)
    return RecomputePolicy("mc-offload", layers)


@per_graph
def stock_offload_layer(graph: LayerGraph) -> LayerPolicy:
    """A layer of `mc-offload` below the margin: everything kept, every stock module's inputs offloaded (fraction 1);
    no layer of a `megatron_offload_policy` stage offloads more (the search's memory bound reads it)."""
    base = keep_all(graph)
    ops = frozenset(n for m in STOCK_MODULES for n in module_offload_ops(graph, m))
    return LayerPolicy(base.keep, base.recompute, offload=ops & base.keep)


def offload_all_policy(ctx: StageContext, graph: LayerGraph) -> RecomputePolicy:
    """Keep every activation and offload all of it (no margin, no recomputation): the bound that maximises the
    memory saved and the copy volume."""
    base = keep_all(graph)
    off = frozenset(n for n in base.keep if graph.keep_bytes(n) > 0)
    return RecomputePolicy("offload-all", (LayerPolicy(base.keep, base.recompute, offload=off),) * ctx.num_layers)
