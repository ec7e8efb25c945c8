"""Rule-based policies (no search): none, Megatron full, Megatron selective, Megatron uniform / block."""

from __future__ import annotations

from lynx.graph import LAYER_INPUT, LayerGraph
from lynx.policy.base import LayerPolicy, Phase, RecomputePolicy, StageContext


def keep_all(graph: LayerGraph) -> LayerPolicy:
    """No recomputation: keep every op whose state backward reads."""
    return LayerPolicy(keep=graph.needed())


def recompute_closure(graph: LayerGraph, drop: frozenset[str], keep: frozenset[str]) -> tuple[str, ...]:
    """Ops to recompute (forward order) so that every dropped op whose state backward reads is restored:
    the dropped needed ops plus, transitively, every input that is neither kept nor the layer input."""
    todo = {n for n in graph.needed() if n in drop}
    out: set[str] = set()
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        todo |= {d for d in graph.op(n).inputs if d != LAYER_INPUT and d not in keep and d not in out}
    return tuple(n for n in graph.names if n in out)


def on_demand(graph: LayerGraph, keep: frozenset[str]) -> LayerPolicy:
    """Keep `keep` (restricted to what backward reads), recompute the rest on demand."""
    keep = frozenset(keep) & graph.needed()
    rec = recompute_closure(graph, frozenset(graph.names) - keep, keep)
    return LayerPolicy(keep=keep, recompute=tuple((n, Phase.ON_DEMAND) for n in rec))


def full_layer(graph: LayerGraph) -> LayerPolicy:
    """Megatron full: keep only the layer input, rerun the whole layer forward (collectives included)."""
    return on_demand(graph, frozenset())


def checkpointed_drops(graph: LayerGraph, ops: tuple[str, ...] | frozenset[str]) -> frozenset[str]:
    """What a Megatron ``tensor_parallel.checkpoint`` around `ops` frees: their outputs, except those a
    backward outside the region still reads (the consumer holds them anyway)."""
    region = set(ops)
    outside = {s for o in graph.ops if o.name not in region for s in o.saved}
    return frozenset(n for n in region if n not in outside)


def selective_layer(graph: LayerGraph) -> LayerPolicy:
    """Megatron selective (Korthikanti et al. 2022): checkpoint core attention (QK^T, softmax, dropout,
    probs @ V); its input (QKV) and output (context, which the projection saves) stay stored. With flash
    attention (one `core_attn` op, whose output the projection saves) nothing is left to drop."""
    return on_demand(graph, graph.needed() - checkpointed_drops(graph, graph.module_ops("core_attn")))


def _same(method: str, lp: LayerPolicy, ctx: StageContext) -> RecomputePolicy:
    return RecomputePolicy(method=method, layers=(lp,) * ctx.num_layers)


def none_policy(ctx: StageContext, graph: LayerGraph) -> RecomputePolicy:
    return _same("none", keep_all(graph), ctx)


def full_policy(ctx: StageContext, graph: LayerGraph) -> RecomputePolicy:
    return _same("full", full_layer(graph), ctx)


def selective_policy(ctx: StageContext, graph: LayerGraph) -> RecomputePolicy:
    return _same("selective", selective_layer(graph), ctx)


def uniform_policy(ctx: StageContext, graph: LayerGraph, num_layers: int = 1) -> RecomputePolicy:
    """Megatron ``--recompute-method uniform --recompute-num-layers N``: the stage's layers are cut into
    chunks of N; only each chunk's input is stored and the whole chunk is rerun before its backward."""
    n = max(1, num_layers)
    full = full_layer(graph)
    chunked = LayerPolicy(keep=full.keep, recompute=full.recompute, input_checkpoint=False)
    layers = tuple(full if i % n == 0 else chunked for i in range(ctx.num_layers))
    return RecomputePolicy(method="uniform", layers=layers)


def block_policy(ctx: StageContext, graph: LayerGraph, num_layers: int = 1) -> RecomputePolicy:
    """Megatron ``--recompute-method block --recompute-num-layers N``: the first N layers of each stage
    are fully recomputed, the others keep everything."""
    n = min(max(0, num_layers), ctx.num_layers)
    layers = tuple(full_layer(graph) if i < n else keep_all(graph) for i in range(ctx.num_layers))
    return RecomputePolicy(method="block", layers=layers)
