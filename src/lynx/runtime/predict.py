"""The planner's prediction of what the recompute engine holds: the analytic graph at the runtime's dtype
and `lynx.cost.memory`'s activation rule with the normalization statistics the runtime also keeps."""

from __future__ import annotations

from typing import Any

import torch

from lynx.cost.memory import layer_memory
from lynx.cost.memory import predicted_activation_bytes as _predicted
from lynx.decisions import RecomputePolicy
from lynx.graph import Graphs, LayerGraph, per_layer
from lynx.schedule import derive_facts, schedule_1f1b


def runtime_graph(graph: LayerGraph, dtype: torch.dtype) -> LayerGraph:
    """The analytic graph (16-bit activations) with activation bytes rescaled to the runtime's dtype;
    dropout masks stay 1 byte per element."""
    from dataclasses import replace

    f = torch.empty((), dtype=dtype).element_size() / 2.0
    ops = tuple(replace(o, out_bytes=o.out_bytes * f) for o in graph.ops)
    return replace(graph, ops=ops, input_bytes=graph.input_bytes * f)


def runtime_extra_bytes(cfg: Any, keep: frozenset[str]) -> int:
    """Bytes the runtime holds for the kept ops `keep` beyond the planner's graph. The mean and 1/std per token that
    a kept LayerNorm's backward also reads (fp32), which the graph folds into the op as negligible: 2 x 4 bytes per
    token per kept LayerNorm (a config may name its own norm ops and bytes per token: RMSNorm keeps 4). A kept
    ``qk_layernorm`` (q/k RMSNorm per head, after the QKV GEMM: every token of the rank's heads, SP or not) keeps 4
    bytes per token and local head. Multi-latent attention as the runtime runs it (its V padded for the fused
    kernel) keeps more than the planner counts for `mla_rope` and `core_attn` (see below)."""
    tok = cfg.seq_length * cfg.micro_batch_size // (cfg.tp if cfg.sequence_parallel else 1)
    per = getattr(cfg, "norm_stats_bytes", 2 * 4)
    out = sum(per * tok for n in getattr(cfg, "norm_ops", ("ln1", "ln2")) if n in keep)
    if "qk_layernorm" in keep and getattr(cfg, "qk_layernorm", False):
        heads = (cfg.num_attention_heads + cfg.groups) // cfg.tp
        out += 4 * cfg.seq_length * cfg.micro_batch_size * heads
    mla = getattr(cfg, "mla", ())
    if mla:  # the runtime's MLA attention (`lynx.runtime.layers.mla`): V padded to the query's head size for the
        # fused kernel, in mla_rope's output and in the kernel's own saved output beside core_attn's
        _, _, dn, dr, dv = mla
        elems = cfg.seq_length * cfg.micro_batch_size * (cfg.num_attention_heads // cfg.tp)
        size = torch.empty((), dtype=cfg.dtype).element_size()
        if "mla_rope" in keep:
            out += size * elems * (dn + dr - dv)
        if "core_attn" in keep:
            out += size * elems * (dn + dr)
    return int(out)


def as_executed(policy: RecomputePolicy) -> RecomputePolicy:
    """The policy as this runtime executes it. Megatron's selective recomputation with flash attention keeps
    `core_attn`'s output and re-runs the kernel in backward to rebuild its side state (`keep+rerun`,
    `LayerPolicy.rerun`); lynx's engine cannot free the side state of an op whose output it keeps, so it runs
    such an op as kept: no re-run, the side state (the log-sum-exp, 1/64 of the output at head dim 128) held.
    Predictions the runtime is measured against are of this policy (docs/runtime.md)."""
    from dataclasses import replace

    if not any(lp.rerun for lp in policy.layers):
        return policy
    return replace(policy, layers=tuple(replace(lp, rerun=frozenset()) for lp in policy.layers))


def predicted_activation_bytes(graph: Graphs, policy: RecomputePolicy, cfg: Any,
                               in_flight: int = 1) -> tuple[float, float]:
    """The planner's view of what the engine measures, from `lynx.cost.memory` on `graph` (bytes in the
    runtime's dtype): (held after the forward passes in flight, peak held including what backward
    restores). In-flight count and forward windows are the schedule's facts for the first stage of an
    `in_flight`-deep 1F1B pipeline. LayerNorm statistics are added as the runtime holds them. `graph`: one graph,
    or one per layer (a stack of several kinds)."""
    k = max(1, in_flight)
    policy = as_executed(policy)
    facts = derive_facts(schedule_1f1b(k, k)).of(0)
    ln = [float(runtime_extra_bytes(cfg, lp.keep)) for lp in policy.layers]
    names = {n for g in per_layer(graph, len(policy.layers)) for n in g.names}
    per_op = {n: float(runtime_extra_bytes(cfg, frozenset({n}))) for n in names}
    after, peak = _predicted(graph, policy.layers, ln, facts.in_flight, facts.has_fwd_windows,
                             {n: b for n, b in per_op.items() if b})
    off = predicted_offloaded_bytes(graph, policy, cfg)
    if not off:
        return after, peak
    # Offloaded bytes leave the device as the forward saves them (the engine's ledger drops them at once) and
    # come back for their micro-batch's backward: after the forwards, none of them is held; at the peak, at most
    # one micro-batch's (the planner's rule, `lynx.cost.memory.held_bytes`: an upper bound, the engine reloads one
    # layer ahead and frees each layer's as its backward ends).
    return after - facts.in_flight * off, peak - (facts.in_flight - 1) * off


def predicted_offloaded_bytes(graph: Graphs, policy: RecomputePolicy, cfg: Any) -> float:
    """Bytes per micro-batch the planner's memory model says leave the device (`LayerMemory.offloaded`, what
    `lynx memory` shows), plus the LayerNorm statistics the runtime's offloaded norms save beside their output
    (as `runtime_extra_bytes` adds them for kept norms)."""
    graphs = per_layer(graph, len(policy.layers))
    return sum(layer_memory(g, lp).offloaded + runtime_extra_bytes(cfg, lp.offload)
               for g, lp in zip(graphs, policy.layers, strict=True))
