"""Multi-latent attention (DeepSeek-V2/V3) as Megatron-Core runs it (megatron/core/transformer/
multi_latent_attention.py, MLASelfAttention, 0.16.1), for `mcore.layer` (docs/decisions/0220).

The Q and KV down-projections are replicated linears (``parallel_mode="duplicated"``) on this rank's tokens
(the sequence-parallel shard when SP is on); their latents are gathered over TP, normalised (q_layernorm,
kv_layernorm) and projected up by column-parallel linears to the rank's heads: Q as qk_head_dim + qk_pos_emb_head_dim
per head, K's no-position part and V from the KV latent, K's rotary part shared by every head from the down
projection. RoPE rotates the position parts; Q, K and V are assembled per head (Q and K at qk_head_dim +
qk_pos_emb_head_dim, V at v_head_dim) and core attention runs on them; the output projection is row-parallel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lynx.families.base import ACT_BYTES, LayerBuilder, cp_flash_attention

if TYPE_CHECKING:
    from lynx.spec import ModelSpec, ParallelSpec


def mla_attention(b: LayerBuilder, m: ModelSpec, par: ParallelSpec, norm: str, tok: float, tok_ln: float) -> str:
    """The attention block after the input norm `norm`; returns the output projection (before its reduction)."""
    h, t, mb = m.hidden_size, par.tp, par.micro_batch_size
    a_l = m.num_attention_heads / t
    ql, kvl, dn, dr, dv = m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    b.gemm("q_down", "attn", tok_ln, h, ql, (norm,), (norm,))
    b.gemm("kv_down", "attn", tok_ln, h, kvl + dr, (norm,), (norm,))
    q_src, kv_src = "q_down", "kv_down"
    if par.sequence_parallel and t > 1:
        lat = ACT_BYTES * tok * (ql + kvl + dr)
        b.comm("attn_allgather", "attn", "gather", lat, ("q_down", "kv_down"), lat, "")
        q_src = kv_src = "attn_allgather"
    b.elementwise("q_layernorm", "attn", tok * ql, (q_src,), (q_src,), flops_per_elem=4, module="layernorm")
    b.elementwise("kv_layernorm", "attn", tok * kvl, (kv_src,), (kv_src,), flops_per_elem=4, module="layernorm")
    b.gemm("q_up", "attn", tok, ql, a_l * (dn + dr), ("q_layernorm",), ("q_layernorm",), module="mla_up_proj")
    b.gemm("kv_up", "attn", tok, kvl, a_l * (dn + dv), ("kv_layernorm",), ("kv_layernorm",), module="mla_up_proj")
    # RoPE on the position parts, then Q, K, V per head for the attention kernel (new tensors: K's rotary part
    # is expanded to every head)
    qkv_elems = tok * a_l * (2 * (dn + dr) + dv)
    b.elementwise("mla_rope", "attn", qkv_elems, ("q_up", "kv_up", kv_src), (), reads=1, flops_per_elem=1,
                  module="mla_up_proj")
    # core attention at an equivalent head size: QK^T over dn + dr, PV over dv (FLOPs 2 s^2 (dn + dr + dv) / 2
    # per head, causal, as two GEMMs of head size (dn + dr + dv) / 2)
    d_eq = (dn + dr + dv) / 2
    ctx = cp_flash_attention(b, par, mb, a_l, a_l, d_eq, "mla_rope", "mla_rope")
    b.gemm("attn_proj", "attn", tok, a_l * dv, h, (ctx,), (ctx,))
    return "attn_proj"


def mla_params(m: ModelSpec, tp: int) -> float:
    """One MLA block's parameters on a TP rank: the replicated down projections and latent norms, the
    column-parallel up projections and the row-parallel output projection."""
    h, a = m.hidden_size, m.num_attention_heads
    ql, kvl, dn, dr, dv = m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    replicated = h * ql + h * (kvl + dr) + ql + kvl
    split = ql * a * (dn + dr) + kvl * a * (dn + dv) + a * dv * h
    return replicated + split / tp


def mla_flops_per_token(m: ModelSpec, s: int) -> float:
    """Forward GEMM and attention-matmul FLOPs of one MLA block per token (attention counted in full)."""
    h, a = m.hidden_size, m.num_attention_heads
    ql, kvl, dn, dr, dv = m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    gemms = h * ql + h * (kvl + dr) + ql * a * (dn + dr) + kvl * a * (dn + dv) + a * dv * h
    return 2 * gemms + 2 * s * a * (dn + dr + dv)


__all__ = ["mla_attention", "mla_flops_per_token", "mla_params"]
