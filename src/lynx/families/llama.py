"""The LLaMA family (LLaMA 2/3, Mistral, Qwen2-style decoders): RMSNorm, grouped-query attention with
rotary positions, SwiGLU MLP, no biases, no dropout by default, untied embeddings, flash attention.

Op vocabulary with flash attention and no sequence parallelism:
``rmsnorm1, qkv, rope, core_attn, attn_proj, attn_allreduce, attn_residual, rmsnorm2, gate_up, swiglu, down,
mlp_allreduce, mlp_residual``; with sequence parallelism the all-reduces become all-gather / reduce-scatter
pairs as in GPT; with standard attention ``core_attn`` becomes ``attn_scores, softmax, [attn_dropout,]
attn_context``.

Tensor parallelism as Megatron-Core: the QKV GEMM is column-parallel with whole query groups per rank
(each rank: a/t query heads and g/t K/V heads), the output projection row-parallel; gate and up are one
fused column-parallel GEMM, down is row-parallel. The SwiGLU is fused (one op whose backward reads only the
gate/up output, as Megatron's bias-SwiGLU fusion); docs/costmodel.md derives the per-layer activation
bytes and the unfused variant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lynx.errors import SpecError
from lynx.families import fusion
from lynx.families.base import (
    ACT_BYTES,
    LAYER_INPUT,
    Family,
    LayerBuilder,
    LayerSpec,
    cp_flash_attention,
    standard_attention,
)

if TYPE_CHECKING:
    from lynx.spec import ModelSpec, ParallelSpec

DEFAULTS = {"activation": "swiglu", "normalization": "rmsnorm", "position_embedding": "rope",
            "tie_embeddings": False, "attention": "flash", "dropout": False, "bias": "none"}
MLP_OPS = ("mlp_allgather", "gate_up", "swiglu", "down")


def check_model(m: ModelSpec) -> None:
    check_fields(m)
    fusion.check_kv_repeat(m)
    fusion.check_compiled(m)


def check_fields(m: ModelSpec) -> None:
    """LLaMA's activation, norm, position embedding and biases (shared with the torchtitan family)."""
    want = {"activation": "swiglu", "normalization": "rmsnorm", "position_embedding": "rope", "bias": "none"}
    for k, v in want.items():
        if getattr(m, k) != v:
            raise SpecError(f"model {m.name!r}: family llama has {k} {v}, got {getattr(m, k)!r} "
                            "(family mcore takes any combination Megatron-Core accepts)")


def check_layout(m: ModelSpec, tp: int) -> None:
    """Megatron-Core's rule: each TP rank holds whole query groups, so num_query_groups must be a multiple
    of TP (TransformerConfig.__post_init__ raises otherwise; it does not replicate K/V heads)."""
    if m.num_attention_heads % tp:
        raise SpecError(f"{m.name}: {m.num_attention_heads} attention heads are not divisible by TP {tp}")
    if m.num_query_groups % tp:
        raise SpecError(f"{m.name}: {m.num_query_groups} query groups (K/V heads) are not divisible by TP {tp}; "
                        "Megatron-Core needs num_query_groups to be a multiple of TP (use TP <= "
                        f"{m.num_query_groups} dividing it)")
    if m.hidden_size % tp or m.ffn_hidden_size % tp:
        raise SpecError(f"{m.name}: hidden size {m.hidden_size} / FFN {m.ffn_hidden_size} not divisible by TP {tp}")


def layer(model: ModelSpec, par: ParallelSpec) -> LayerSpec:
    """The ops of one LLaMA layer on one TP rank."""
    b = LayerBuilder(main_grad_pass=not model.gradient_accumulation_fusion)
    s, mb, h, a, g, f, t = (par.seq_length, par.micro_batch_size, model.hidden_size, model.num_attention_heads,
                            model.num_query_groups, model.ffn_hidden_size, par.tp)
    sp = par.sequence_parallel
    tok = s * mb // par.cp                       # tokens of the micro-batch on this rank (s / CP each)
    tok_ln = tok / t if sp else tok
    d = model.head_dim
    a_l, g_l = a / t, g / t                      # query heads and K/V heads on one rank
    drop_res = model.dropout and model.hidden_dropout > 0
    drop_attn = model.dropout and model.attention_dropout > 0

    # --- attention block -----------------------------------------------------------------------------
    # RMSNorm's backward reads its input (and an fp32 1/rms per token, folded in as negligible).
    b.elementwise("rmsnorm1", "attn", tok_ln * h, (LAYER_INPUT,), (LAYER_INPUT,), flops_per_elem=4,
                  module="layernorm")
    qkv_in = "rmsnorm1"
    if sp:
        b.comm("attn_allgather", "attn", "gather", ACT_BYTES * tok * h, ("rmsnorm1",), ACT_BYTES * tok * h, "qkv",
               regather=True)
        qkv_in = "attn_allgather"
    # Column-parallel QKV: [tok, h] @ [h, (a + 2g) d / t], per group [q .. q | k | v] (Megatron's layout).
    b.gemm("qkv", "attn", tok, h, (a_l + 2 * g_l) * d, (qkv_in,), ("rmsnorm1",))
    # RoPE rotates Q and K into a new tensor; its backward rotates the gradient back (reads only the
    # cos/sin tables, which are buffers).
    b.elementwise("rope", "attn", tok * (a_l + g_l) * d, ("qkv",), (), flops_per_elem=3)
    if model.attention == "flash":
        # Saves rotated Q, K (the rope output), V (a view of the QKV output), its output and the LSE; with
        # context parallelism ring attention (or its a2a / all-gather variants) over the CP ranks.
        ctx = cp_flash_attention(b, par, mb, a_l, g_l, d, "rope", "qkv")
    else:
        ctx = standard_attention(b, "rope", "qkv", s, mb, a_l, d, drop_attn)
    b.gemm("attn_proj", "attn", tok, a_l * d, h, (ctx,), (ctx,))
    red = "attn_reducescatter" if sp else "attn_allreduce"
    if sp:
        b.comm(red, "attn", "gather", ACT_BYTES * tok * h, ("attn_proj",), ACT_BYTES * tok_ln * h, "")  # exposed
    else:
        b.comm(red, "attn", "allreduce", ACT_BYTES * tok * h, ("attn_proj",), ACT_BYTES * tok * h, "qkv")
    b.elementwise("attn_residual", "attn", tok_ln * h, (red, LAYER_INPUT), ("attn_residual",) if drop_res else (),
                  reads=2, mask=drop_res)

    # --- MLP block -----------------------------------------------------------------------------------
    b.elementwise("rmsnorm2", "mlp", tok_ln * h, ("attn_residual",), ("attn_residual",), flops_per_elem=4,
                  module="layernorm")
    up_in = "rmsnorm2"
    if sp:
        b.comm("mlp_allgather", "mlp", "gather", ACT_BYTES * tok * h, ("rmsnorm2",), ACT_BYTES * tok * h,
               "gate_up", module="mlp", regather=True)
        up_in = "mlp_allgather"
    b.gemm("gate_up", "mlp", tok, h, 2 * f / t, (up_in,), ("rmsnorm2",), module="mlp")
    # Fused SwiGLU: silu(gate) * up from [tok, 2f/t] to [tok, f/t]; backward reads only its input.
    b.elementwise("swiglu", "mlp", tok * 2 * f / t, ("gate_up",), ("gate_up",), flops_per_elem=3,
                  out_elems=tok * f / t, module="mlp")
    b.gemm("down", "mlp", tok, f / t, h, ("swiglu",), ("swiglu",), module="mlp")
    red = "mlp_reducescatter" if sp else "mlp_allreduce"
    if sp:
        b.comm(red, "mlp", "gather", ACT_BYTES * tok * h, ("down",), ACT_BYTES * tok_ln * h, "")  # exposed
    else:
        b.comm(red, "mlp", "allreduce", ACT_BYTES * tok * h, ("down",), ACT_BYTES * tok * h, "gate_up")
    b.elementwise("mlp_residual", "mlp", tok_ln * h, (red, "attn_residual"), ("mlp_residual",) if drop_res else (),
                  reads=2, mask=drop_res)
    fusion.apply(b, model)  # the memory-bound ops a disabled fusion runs eager
    return b.spec(ACT_BYTES * tok_ln * h)


def layer_params(m: ModelSpec, tp: int) -> float:
    """One layer on one TP rank: QKV, output, gate/up and down weights split (no biases); the two RMSNorm
    weights replicated."""
    h, a, g, f, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size, m.head_dim
    split = h * (a + 2 * g) * d + a * d * h + 2 * h * f + f * h
    return split / tp + 2 * h


def embedding_params(m: ModelSpec, tp: int) -> float:
    """Vocab-parallel word embedding; rotary positions have no parameters."""
    return m.vocab_size * m.hidden_size / tp


def final_norm_params(m: ModelSpec) -> float:
    return m.hidden_size


def head_params(m: ModelSpec, tp: int, pp: int) -> float:
    """Final RMSNorm and the vocab-parallel LM head (untied; tied with PP > 1 Megatron keeps a copy)."""
    head = m.vocab_size * m.hidden_size / tp if (pp > 1 or not m.tie_embeddings) else 0.0
    return final_norm_params(m) + head


def output_params(m: ModelSpec) -> float:
    return m.hidden_size + (0 if m.tie_embeddings else m.vocab_size * m.hidden_size)


def matmul_flops_per_token(m: ModelSpec, s: int) -> float:
    h, a, g, f, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size, m.head_dim
    return 2 * (h * (a + 2 * g) * d + a * d * h + 3 * h * f) + 2 * 2 * s * a * d  # GEMMs + attention


FAMILY = Family(
    name="llama", defaults=DEFAULTS, check_model=check_model, check_layout=check_layout, layer=layer,
    layer_params=layer_params, embedding_params=embedding_params, head_params=head_params,
    final_norm_params=final_norm_params,
    output_params=output_params, matmul_flops_per_token=matmul_flops_per_token,
    runtime_module="lynx.runtime.layers.llama",
)
