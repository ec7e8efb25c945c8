"""Multi-latent attention (DeepSeek-V2/V3, Megatron-Core's ``MLASelfAttention``) for the runtime's LLaMA layer, op by
op as the planner's `lynx.families.mla` lists it, so the recompute engine drops and restores each:

- ``q_down`` / ``kv_down``: the replicated down projections to the query latent (q_lora_rank) and to the key/value
  latent plus the shared rotary key part (kv_lora_rank + qk_pos_emb_head_dim), on this rank's tokens; with SP
  ``attn_allgather`` gathers both latents along the sequence (one collective, [q latent | kv latent]);
- ``q_layernorm`` / ``kv_layernorm``: RMSNorm over each latent (the key's rotary part is not normalized);
- ``q_up`` / ``kv_up``: column-parallel up projections to this rank's heads, [a_l, dn + dr] and [a_l, dn + dv];
- ``mla_rope``: RoPE on the query's and the shared key's rotary parts, the key's expanded to every head, into one
  tensor [s, b, a_l, 2 (dn + dr) + dv] holding Q, K and V per head (nothing saved);
- ``core_attn``: causal attention (`scaled_dot_product_attention`) with head size dn + dr for Q K^T and dv for V,
  softmax scale 1 / sqrt(dn + dr); ``attn_proj``: row-parallel, from a_l x dv.

The down projections and the latent norms are replicated over TP; with SP each TP rank's heads (the norms) or tokens
(the down projections) give them a partial gradient, summed over TP (`tp_partial`), as Megatron-Core does. RoPE is
plain (base `rope_theta`); DeepSeek-V3's YaRN scaling of the rotary part changes neither the time nor the memory a
plan prices."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lynx.runtime.layers import tp
from lynx.runtime.layers.rope import register_tables, rotate_half


def build(layer: Any, base: int, out_std: float, kw: dict[str, Any]) -> tuple[torch.nn.Module, ...]:
    """The block's parameters on `layer` (a `LlamaLayer` whose config has `mla`); returns its TP linears."""
    cfg, group = layer.cfg, layer.group
    ql, kvl, dn, dr, dv = cfg.mla
    h, a = cfg.hidden_size, cfg.num_attention_heads
    gen = torch.Generator().manual_seed(base + 6)  # the same on every TP rank: replicated weights
    layer.q_down = torch.nn.Parameter(torch.empty(ql, h).normal_(0, 0.02, generator=gen).to(**kw))
    layer.kv_down = torch.nn.Parameter(torch.empty(kvl + dr, h).normal_(0, 0.02, generator=gen).to(**kw))
    layer.q_latent_norm = torch.nn.Parameter(torch.ones(ql, **kw))
    layer.kv_latent_norm = torch.nn.Parameter(torch.ones(kvl, **kw))
    if cfg.sequence_parallel:  # the up projections' input gradient is summed by the gather's reduce-scatter, after
        # the latent norms' backward (each TP rank's heads: partial) and before the down projections' (each rank's
        # tokens: partial); without SP the up projections all-reduce it first and every gradient is whole
        for p in (layer.q_latent_norm, layer.kv_latent_norm, layer.q_down, layer.kv_down):
            p.tp_partial = True
    layer.q_up = tp.ColumnParallelLinear(ql, a * (dn + dr), group, seed=base + 1, **kw)
    layer.kv_up = tp.ColumnParallelLinear(kvl, a * (dn + dv), group, seed=base + 7, **kw)
    layer.proj = tp.RowParallelLinear(a * dv, h, group, seed=base + 2, std=out_std, **kw)
    register_tables(layer, cfg.rope_theta, cfg.seq_length, dr, kw)  # the rotary part's angles
    return layer.q_up, layer.kv_up, layer.proj


def rope(layer: Any, q_up: torch.Tensor, kv_up: torch.Tensor, kv_latent: torch.Tensor) -> torch.Tensor:
    """``mla_rope``: [s, b, a_l, 3 (dn + dr)] = Q | K | V per head, V zero-padded to the query's head size: the fused
    attention kernel takes one head size (flash attention's rule, on CPU too: with two it falls back to the unfused
    kernel, which saves the s x s probabilities); the padding is (dn + dr - dv) / (2 (dn + dr) + dv) more than the
    planner counts for this output (1/8 at DeepSeek-V3's head sizes)."""
    _, kvl, dn, dr, dv = layer.cfg.mla
    s, b = q_up.shape[0], q_up.shape[1]
    a_l = layer.heads_local
    cos, sin = layer.cos[:s], layer.sin[:s]
    q = q_up.view(s, b, a_l, dn + dr)
    q_pe = q[..., dn:]
    q_pe = q_pe * cos + rotate_half(q_pe) * sin
    kv = kv_up.view(s, b, a_l, dn + dv)
    k_pe = kv_latent[..., -dr:].unsqueeze(2)  # [s, b, 1, dr]: one rotary key part shared by every head
    k_pe = (k_pe * cos + rotate_half(k_pe) * sin).expand(s, b, a_l, dr)
    return torch.cat([q[..., :dn], q_pe, kv[..., :dn], k_pe, F.pad(kv[..., dn:], (0, dn + dr - dv))], -1)


def core(layer: Any, qkv: torch.Tensor) -> torch.Tensor:
    """``core_attn``: causal attention over the Q, K, V of `mla_rope`'s output; [s, b, a_l x dv] (V's padding
    dropped)."""
    _, _, dn, dr, dv = layer.cfg.mla
    s, b, a_l = qkv.shape[0], qkv.shape[1], qkv.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.split([dn + dr] * 3, -1))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out[..., :dv].permute(2, 0, 1, 3).reshape(s, b, a_l * dv)

