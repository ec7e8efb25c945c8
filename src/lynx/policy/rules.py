"""Rule-based policies (no search): none, Megatron full, Megatron selective, Megatron uniform / block."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lynx.decisions import LayerPolicy, Phase, RecomputePolicy, StageContext
from lynx.graph import LAYER_INPUT, LayerGraph, per_graph


@per_graph
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


@per_graph
def on_demand(graph: LayerGraph, keep: frozenset[str]) -> LayerPolicy:
    """Keep `keep` (restricted to what backward reads), recompute the rest on demand: `saved_outputs` of the kept
    names some backward reads (Megatron's keep sets)."""
    return saved_outputs(graph, frozenset(keep) & graph.needed())


@per_graph
def saved_outputs(graph: LayerGraph, save: frozenset[str]) -> LayerPolicy:
    """torch's selective activation checkpointing (`torch.utils.checkpoint` with a policy marking `save` MUST_SAVE,
    as torchtitan's per-op SAC and lynx's torchtitan export configure it): the outputs of `save` are stored at the
    forward whether or not a backward reads them, and the recomputation returns them instead of running their ops;
    everything else a backward reads is recomputed on demand from them. Unlike `on_demand`, a saved output no
    backward reads is kept (its bytes held): it is where the recomputation of what follows it starts (a QKV GEMM's
    output feeding RoPE: the GEMM is not re-run)."""
    keep = frozenset(save) & frozenset(graph.names)
    rec = recompute_closure(graph, frozenset(graph.names) - keep, keep)
    return LayerPolicy(keep=keep, recompute=tuple((n, Phase.ON_DEMAND) for n in rec))


@per_graph
def full_layer(graph: LayerGraph) -> LayerPolicy:
    """Megatron full: keep only the layer input, rerun the whole layer forward (collectives included)."""
    return on_demand(graph, frozenset())


def checkpointed_drops(graph: LayerGraph, ops: tuple[str, ...] | frozenset[str]) -> frozenset[str]:
    """What a Megatron ``tensor_parallel.checkpoint`` around `ops` frees: their outputs, except those a
    backward outside the region still reads (the consumer holds them anyway)."""
    region = set(ops)
    outside = {s for o in graph.ops if o.name not in region for s in o.saved}
    return frozenset(n for n in region if n not in outside)


def checkpointed_reruns(graph: LayerGraph, ops: tuple[str, ...] | frozenset[str]) -> frozenset[str]:
    """Ops of a Megatron ``tensor_parallel.checkpoint`` region that stay kept (a backward outside the region
    reads their output) but lose side state the checkpoint discards: the region runs under no_grad, so what
    an op saves besides its output (flash attention's fp32 log-sum-exp, a dropout mask) is gone, and backward
    re-runs the region to rebuild it (megatron/core/tensor_parallel/random.py, CheckpointFunction). Kept ops
    without side state are re-run by Megatron too, but their backward can run from what is stored; lynx does
    not charge that re-run (docs/costmodel.md, "Selective recomputation: what Megatron re-runs")."""
    dropped = checkpointed_drops(graph, ops)
    return frozenset(n for n in ops if n not in dropped and n in graph.needed() and graph.op(n).mask_bytes > 0)


def checkpointed_layer(graph: LayerGraph, ops: tuple[str, ...] | frozenset[str]) -> LayerPolicy:
    """Megatron checkpointing `ops`: what the region frees is recomputed on demand, what it keeps but must
    re-run is kept and re-run (`checkpointed_reruns`)."""
    lp = on_demand(graph, graph.needed() - checkpointed_drops(graph, ops))
    rerun = checkpointed_reruns(graph, ops) & lp.keep
    return LayerPolicy(keep=lp.keep, recompute=lp.recompute + rerun_inputs(graph, rerun, lp), rerun=rerun)


def rerun_inputs(graph: LayerGraph, rerun: frozenset[str], lp: LayerPolicy) -> tuple[tuple[str, Phase], ...]:
    """Inputs of re-run ops that nothing keeps or recomputes: transient collectives the re-run repeats (ring
    attention's K/V exchange with context parallelism: TransformerEngine's attention re-runs its ring when
    the checkpoint re-runs it), recomputed on demand with it."""
    have = set(lp.keep) | {n for n, _ in lp.recompute}
    need = {d for n in rerun for d in graph.op(n).inputs if d != LAYER_INPUT and d not in have}
    return tuple((n, Phase.ON_DEMAND) for n in graph.names if n in need)


@per_graph
def selective_layer(graph: LayerGraph) -> LayerPolicy:
    """Megatron selective (Korthikanti et al. 2022): checkpoint core attention (QK^T, softmax, dropout,
    probs @ V); its input (QKV) and output (context, which the projection saves) stay stored. With flash
    attention (one `core_attn` op) the projection still holds the attention output, the kernel's
    log-sum-exp is freed, and Megatron re-runs the kernel before its backward: `core_attn` is kept and re-run
    (its forward time on the critical path per layer and micro-batch)."""
    return checkpointed_layer(graph, graph.module_ops("core_attn"))


@dataclass(frozen=True, slots=True)
class UniformLayers:
    """A stage policy that gives every layer one policy of its graph alone (Megatron's none, full, selective and
    --recompute-modules lists). Marked so, `methods.common.stage_policy` builds an interleaved stage of one layer
    kind at once rather than chunk by chunk (the search asks for these on every layout it bounds)."""

    method: str
    layer: Callable[[LayerGraph], LayerPolicy]

    def __call__(self, ctx: StageContext, graph: LayerGraph) -> RecomputePolicy:
        return RecomputePolicy(method=self.method, layers=(self.layer(graph),) * ctx.num_layers)


def titan_sac_keep(graph: LayerGraph, gemms: str = "alternate") -> frozenset[str]:
    """What torchtitan's per-op selective AC (``SelectiveAC``, its default) marks MUST_SAVE in a block: the
    attention kernel, the reduce-scatters of sequence parallelism (``reduce_scatter_tensor`` is on its save list at
    9dec370, 820504e and 0.3.0), and the weight GEMMs as `gemms` says. "alternate": every other ``aten.mm`` in
    forward order (the 1st, 3rd, ...), torchtitan's rule for 16-bit GEMMs. Float8Linear's GEMMs are
    ``aten._scaled_mm``, which the rule does not count: "none" where its save list lacks it (9dec370, 820504e: the
    2024-2025 Float8 runs recompute every GEMM), "all" where it holds it (0.3.0 saves torch's compute-intensive
    ops, ``_scaled_mm`` among them). Everything else is recomputed."""
    mms = [o.name for o in graph.ops if o.wgrad_time > 0]
    saved = {"alternate": mms[::2], "all": mms, "none": []}[gemms]
    scatters = {o.name for o in graph.ops if o.is_comm and o.name.endswith("_reducescatter")}
    return frozenset(saved) | frozenset({"core_attn"} & set(graph.names)) | scatters


@per_graph
def titan_sac_layer(graph: LayerGraph) -> LayerPolicy:
    """torchtitan's per-op selective AC as torch runs it (`saved_outputs` of `titan_sac_keep`)."""
    return saved_outputs(graph, titan_sac_keep(graph))


none_policy = UniformLayers("none", keep_all)
full_policy = UniformLayers("full", full_layer)
selective_policy = UniformLayers("selective", selective_layer)
titan_sac_policy = UniformLayers("titan-sac", titan_sac_layer)


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
    full, kept = full_layer(graph), keep_all(graph)  # once per stage: both are pure functions of the graph
    layers = tuple(full if i < n else kept for i in range(ctx.num_layers))
    return RecomputePolicy(method="block", layers=layers)
