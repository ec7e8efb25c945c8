"""A mixture-of-experts MLP block as Megatron-Core runs it (megatron/core/transformer/moe/, 0.16.1): the ops of
one MoE layer's MLP on one rank, for `mcore.layer` (docs/decisions/0220).

MoELayer.forward: the shared expert (SharedExpertMLP, a dense MLP on the TP group, module ``shared_experts``)
and the router (a replicated [h, E] linear, fp32 scores, top-k) read the pre-MLP norm; the token dispatcher
permutes each token to its top-k experts and moves it to the expert's rank, the experts (TEGroupedMLP with
--moe-grouped-gemm, else SequentialMLP: one GEMM per local expert) run FC1, the activation (module ``moe_act``)
and FC2, the dispatcher brings the outputs back and unpermute sums them weighted by the router's probabilities.

* alltoall / flex: all-to-all over the EP group (EP ranks ETP apart), then with ETP > 1 an all-gather of the
  received tokens over the expert-TP group; back: reduce-scatter over ETP, all-to-all over EP. flex (DeepEP)
  moves the same bytes; it is priced as alltoall.
* allgather (Megatron's default): all-gather of the hidden states over the ETP x EP group, each rank selects
  the tokens routed to its local experts; back: reduce-scatter over the same group.

Every collective is a comm op of the MLP block: Lynx's MLP windows (phases 2 and 3) include them. Sizes follow
the busiest rank (`routing_factor`): balanced routing (1.0) gives every local expert tok x topk / E tokens.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lynx.families.base import ACT_BYTES, LayerBuilder

if TYPE_CHECKING:
    from lynx.spec import ModelSpec, ParallelSpec

ROUTER_BYTES = 4.0
"""The router's scores in fp32 (Megatron-Core TopKRouter.gating casts the logits to fp32 with
--moe-router-dtype fp32; DeepSeek-V3 and Qwen3 recipes set it; without it 16-bit, a small difference)."""


def routing_factor(m: ModelSpec) -> float:
    """Tokens the busiest expert rank computes over the balanced share: the stated imbalance, capped by a capacity
    factor (dropped tokens beyond it), exactly the capacity when inputs are padded to it."""
    cap = m.moe_expert_capacity_factor
    if cap is not None and m.moe_pad_expert_input_to_capacity:
        return cap
    return min(m.moe_imbalance, cap) if cap is not None else m.moe_imbalance


def _experts(b: LayerBuilder, m: ModelSpec, par: ParallelSpec, src: str, n_in: float) -> str:
    """FC1, activation, FC2 of this rank's E / EP experts over `n_in` tokens (all of them together)."""
    local = m.num_moe_experts / par.ep
    f, etp, h = m.expert_ffn, par.expert_tp, m.hidden_size
    gated = m.activation == "swiglu"
    t_e = n_in / local  # tokens per local expert
    b.gemm("experts_fc1", "mlp", t_e, h, (2 if gated else 1) * f / etp, (src,), (src,), batch=local, module="moe")
    b.elementwise("experts_act", "mlp", n_in * (2 if gated else 1) * f / etp, ("experts_fc1",), ("experts_fc1",),
                  flops_per_elem=3 if gated else 8, out_elems=n_in * f / etp if gated else None, module="moe_act")
    b.gemm("experts_fc2", "mlp", t_e, f / etp, h, ("experts_act",), ("experts_act",), batch=local, module="moe")
    if not m.moe_grouped_gemm and local > 1:  # SequentialMLP: one GEMM launch per local expert
        for name in ("experts_fc1", "experts_fc2"):
            i = next(j for j, o in enumerate(b.ops) if o.name == name)
            b.ops[i] = dataclasses.replace(b.ops[i], kernels=local)
    return "experts_fc2"


def _shared(b: LayerBuilder, m: ModelSpec, par: ParallelSpec, norm: str, tok: float, tok_ln: float) -> str:
    """The shared expert: a dense MLP over the TP group (SharedExpertMLP), sequence-parallel like the layer's."""
    h, f, t, sp = m.hidden_size, m.moe_shared_expert_intermediate_size, par.tp, par.sequence_parallel
    gated = m.activation == "swiglu"
    src = norm
    if sp:
        b.comm("shared_allgather", "mlp", "gather", ACT_BYTES * tok * h, (norm,), ACT_BYTES * tok * h,
               "shared_fc1", module="shared_experts", regather=True)
        src = "shared_allgather"
    b.gemm("shared_fc1", "mlp", tok, h, (2 if gated else 1) * f / t, (src,), (norm,), module="shared_experts")
    b.elementwise("shared_act", "mlp", tok * (2 if gated else 1) * f / t, ("shared_fc1",), ("shared_fc1",),
                  flops_per_elem=3 if gated else 8, out_elems=tok * f / t if gated else None,
                  module="shared_experts")
    b.gemm("shared_fc2", "mlp", tok, f / t, h, ("shared_act",), ("shared_act",), module="shared_experts")
    if t == 1:
        return "shared_fc2"
    if sp:
        b.comm("shared_reducescatter", "mlp", "gather", ACT_BYTES * tok * h, ("shared_fc2",), ACT_BYTES * tok_ln * h,
               "", module="shared_experts")
        return "shared_reducescatter"
    b.comm("shared_allreduce", "mlp", "allreduce", ACT_BYTES * tok * h, ("shared_fc2",), ACT_BYTES * tok * h,
           "shared_fc1", module="shared_experts")
    return "shared_allreduce"


def moe_mlp(b: LayerBuilder, m: ModelSpec, par: ParallelSpec, norm: str, tok: float, tok_ln: float) -> tuple[str, ...]:
    """The MoE block after the pre-MLP norm `norm` (tok_ln tokens on this rank); returns the ops the residual
    add reads (the unpermuted expert output, and the shared expert's output when there is one)."""
    h, e, k = m.hidden_size, m.num_moe_experts, m.moe_router_topk
    outs: list[str] = []
    if m.moe_shared_expert_intermediate_size:
        outs.append(_shared(b, m, par, norm, tok, tok_ln))
    b.gemm("router", "mlp", tok_ln, h, e, (norm,), (norm,), module="moe")
    b.elementwise("router_topk", "mlp", tok_ln * e, ("router",), ("router_topk",), flops_per_elem=5,
                  out_elems=tok_ln * k * ROUTER_BYTES / ACT_BYTES, module="moe")
    f = routing_factor(m)
    if m.moe_token_dispatcher_type == "allgather":
        group = par.expert_tp * par.ep
        gathered = tok_ln * group
        b.comm("dispatch_allgather", "mlp", "tpep_gather", ACT_BYTES * gathered * h, (norm, "router_topk"),
               ACT_BYTES * gathered * h, "", module="moe")
        n_in = gathered * k / par.ep * f  # tokens routed to this rank's E / EP experts
        b.elementwise("permute", "mlp", n_in * h, ("dispatch_allgather",), (), reads=gathered / n_in if n_in else 1,
                      flops_per_elem=0, module="moe")
        last = _experts(b, m, par, "permute", n_in)
        b.elementwise("unpermute", "mlp", n_in * h, (last, "router_topk"), (last, "router_topk"),
                      flops_per_elem=2, out_elems=gathered * h, module="moe")
        b.comm("combine_reducescatter", "mlp", "tpep_gather", ACT_BYTES * gathered * h, ("unpermute",),
               ACT_BYTES * tok_ln * h, "", module="moe")
        return ("combine_reducescatter", *outs)
    sent = tok_ln * k  # token copies this rank sends (its own experts' share included)
    b.elementwise("permute", "mlp", sent * h, (norm, "router_topk"), (), reads=1 / k, flops_per_elem=0, module="moe")
    recv = sent * f
    b.comm("dispatch_a2a", "mlp", "ep_a2a", ACT_BYTES * recv * h, ("permute",), ACT_BYTES * recv * h, "",
           module="moe")
    _dedup(b, m)
    src, n_in = "dispatch_a2a", recv
    if par.expert_tp > 1:
        n_in = recv * par.expert_tp
        b.comm("dispatch_allgather", "mlp", "etp_gather", ACT_BYTES * n_in * h, (src,), ACT_BYTES * n_in * h, "",
               module="moe")
        src = "dispatch_allgather"
    last = _experts(b, m, par, src, n_in)
    if par.expert_tp > 1:
        b.comm("combine_reducescatter", "mlp", "etp_gather", ACT_BYTES * n_in * h, (last,), ACT_BYTES * recv * h,
               "", module="moe")
        last = "combine_reducescatter"
    b.comm("combine_a2a", "mlp", "ep_a2a", ACT_BYTES * recv * h, (last,), ACT_BYTES * sent * h, "", module="moe")
    _dedup(b, m)
    b.elementwise("unpermute", "mlp", sent * h, ("combine_a2a", "router_topk"), ("combine_a2a", "router_topk"),
                  flops_per_elem=2, out_elems=tok_ln * h, module="moe")
    return ("unpermute", *outs)


def _dedup(b: LayerBuilder, m: ModelSpec) -> None:
    """The flex dispatcher (DeepEP) sends a token to each remote node once and forwards it over NVLink inside
    the node (DeepSeek-V3 report, arXiv 2412.19437, sec. 3.2.2; DeepEP's internode kernels); the combine reduces
    per node before crossing back. Marks the last all-to-all added."""
    if m.moe_token_dispatcher_type == "flex":
        b.ops[-1] = dataclasses.replace(b.ops[-1], node_dedup_topk=m.moe_router_topk,
                                        node_groups=(m.moe_router_num_groups, m.moe_router_group_topk)
                                        if m.moe_router_group_topk else (0, 0))


def router_params(m: ModelSpec) -> float:
    """The router's [E, h] weight (replicated on every rank), plus DeepSeek-V3's per-expert score bias (a
    buffer in Megatron, not trained by the optimizer; left out)."""
    return m.num_moe_experts * m.hidden_size


def expert_params(m: ModelSpec) -> float:
    """All routed experts of one MoE layer (FC1 with the gate, FC2; no biases in Megatron's grouped experts)."""
    up = 2 if m.activation == "swiglu" else 1
    return m.num_moe_experts * (up + 1) * m.hidden_size * m.expert_ffn


def shared_params(m: ModelSpec) -> float:
    up = 2 if m.activation == "swiglu" else 1
    return (up + 1) * m.hidden_size * m.moe_shared_expert_intermediate_size


def active_mlp_flops_per_token(m: ModelSpec) -> float:
    """Forward GEMM FLOPs of one MoE block per token: top-k experts, the shared expert and the router."""
    up = 2 if m.activation == "swiglu" else 1
    return 2 * ((up + 1) * m.hidden_size * (m.moe_router_topk * m.expert_ffn + m.moe_shared_expert_intermediate_size)
                + m.hidden_size * m.num_moe_experts)
