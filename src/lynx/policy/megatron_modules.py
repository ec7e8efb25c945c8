"""Megatron-Core's selective recomputation by module list: ``--recompute-granularity selective
--recompute-modules core_attn mlp layernorm`` (any combination), as baselines.

Megatron's semantics (megatron/core/transformer/transformer_layer.py, attention.py, and the argument's help):

- ``core_attn`` and ``mlp`` use ordinary checkpointing (``tensor_parallel.checkpoint``): the module's
  input is stored, everything inside is dropped and rerun before its backward. Outputs are *not* freed by
  the checkpoint: an output that the next op's backward reads stays stored (core attention's output is the
  input the output projection saves, so with flash attention "core_attn" frees only the fp32 log-sum-exp).
- ``layernorm`` uses output-discarding checkpointing (``CheckpointWithoutOutput``): the norm's output is
  freed after the following GEMM consumed it and recomputed from the norm's input (stored anyway) right
  before that GEMM's backward.

Everything not named stays stored. Every recomputation happens on demand (phase 5), as in Megatron.
With flash attention (one ``core_attn`` op) "core_attn" keeps the attention output (the projection saves
it), frees the kernel's fp32 log-sum-exp (b * a/t * s values, 1/64 of the output at head dim 128) and re-runs
the kernel before its backward: the op is kept and re-run (`LayerPolicy.rerun`), costing its forward time on
demand per layer and micro-batch.
"""

from __future__ import annotations

import functools

from lynx.decisions import LayerPolicy, RecomputePolicy, StageContext
from lynx.graph import LayerGraph, per_graph
from lynx.policy.rules import UniformLayers, checkpointed_drops, checkpointed_reruns, on_demand, rerun_inputs

MODULES: tuple[str, ...] = ("core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj")
"""Megatron-Core's --recompute-modules names (TransformerConfig.recompute_modules, 0.16.1). The MoE ones
(docs/decisions/0222): ``moe`` checkpoints the whole MoE block (router, dispatch, experts, combine: the
all-to-alls re-run on demand too), ``moe_act`` discards the experts' activation output, ``shared_experts``
checkpoints the shared expert, ``mla_up_proj`` discards the MLA up projections' and RoPE's outputs."""
OUTPUT_DISCARDING: frozenset[str] = frozenset({"layernorm", "moe_act", "mla_up_proj"})
"""Modules Megatron recomputes with CheckpointWithoutOutput (their outputs are freed too)."""
CONTAINS: dict[str, tuple[str, ...]] = {"moe": ("moe", "moe_act")}
"""Modules whose checkpoint spans another's ops (the MoE block holds the experts' activation)."""


def parse_modules(spec: str | tuple[str, ...]) -> tuple[str, ...]:
    """"core_attn mlp" (or a tuple) -> ("core_attn", "mlp") in MODULES order; ValueError if unknown."""
    names = spec.replace(",", " ").split() if isinstance(spec, str) else list(spec)
    bad = [n for n in names if n not in MODULES]
    if bad or not names:
        raise ValueError(f"recompute modules {' '.join(names) or '(none)'}: choose from {', '.join(MODULES)}")
    return tuple(m for m in MODULES if m in names)


def dropped_ops(graph: LayerGraph, modules: tuple[str, ...]) -> frozenset[str]:
    """The op outputs freed after forward by recomputing `modules`."""
    out: set[str] = set()
    for m in modules:
        ops = _ops(graph, m)
        out |= set(ops) if m in OUTPUT_DISCARDING else checkpointed_drops(graph, ops)
    return frozenset(out)


def _ops(graph: LayerGraph, module: str) -> tuple[str, ...]:
    return tuple(n for o in graph.ops for n in (o.name,) if o.module in CONTAINS.get(module, (module,)))


@per_graph
def modules_layer(graph: LayerGraph, modules: tuple[str, ...]) -> LayerPolicy:
    """Keep everything backward reads except what the modules free; recompute that on demand, and re-run the
    checkpointed ops that stay kept but lose their side state (`rules.checkpointed_reruns`), with the transient
    collectives such a re-run repeats (context parallelism's K/V exchange, `rules.rerun_inputs`)."""
    lp = on_demand(graph, graph.needed() - dropped_ops(graph, modules))
    rerun = frozenset(n for m in modules if m not in OUTPUT_DISCARDING
                      for n in checkpointed_reruns(graph, _ops(graph, m))) & lp.keep
    return LayerPolicy(keep=lp.keep, recompute=lp.recompute + rerun_inputs(graph, rerun, lp), rerun=rerun)


def modules_policy(ctx: StageContext, graph: LayerGraph, modules: tuple[str, ...]) -> RecomputePolicy:
    """Every layer of the stage recomputes `modules` (Megatron applies the list to all layers)."""
    return modules_stage_policy(modules)(ctx, graph)


def modules_stage_policy(modules: tuple[str, ...]) -> UniformLayers:
    """`modules_policy` for one list, as a stage policy marked uniform (`policy.rules.UniformLayers`)."""
    return UniformLayers("mc-" + "+".join(modules), functools.partial(modules_layer, modules=modules))
