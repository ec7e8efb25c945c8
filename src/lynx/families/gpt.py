"""The GPT family (Megatron's GPT, the paper's workloads): LayerNorm, GeLU MLP, learned positions,
multi-head attention (standard, or flash), dropout, word embedding tied to the LM head by default.

Op vocabulary with standard attention and no sequence parallelism (`STANDARD_OPS`):
``ln1, qkv, attn_scores, softmax, attn_dropout, attn_context, attn_proj, attn_allreduce, attn_residual,
ln2, fc1, gelu, fc2, mlp_allreduce, mlp_residual``; with sequence parallelism each all-reduce becomes an
all-gather before the column-parallel GEMM and a reduce-scatter after the row-parallel one (`SP_OPS`); with
flash attention ``attn_scores .. attn_context`` become one ``core_attn``. Bytes follow Korthikanti et al.
2022 (sec. 4.1, Table 2).
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
from lynx.graph import Block

if TYPE_CHECKING:
    from lynx.spec import ModelSpec, ParallelSpec

STANDARD_OPS: tuple[str, ...] = (
    "ln1", "qkv", "attn_scores", "softmax", "attn_dropout", "attn_context", "attn_proj",
    "attn_allreduce", "attn_residual", "ln2", "fc1", "gelu", "fc2", "mlp_allreduce", "mlp_residual",
)
"""The op vocabulary of a GPT layer with standard attention and no sequence parallelism."""

SP_OPS: tuple[str, ...] = (
    "ln1", "attn_allgather", "qkv", "attn_scores", "softmax", "attn_dropout", "attn_context",
    "attn_proj", "attn_reducescatter", "attn_residual", "ln2", "mlp_allgather", "fc1", "gelu", "fc2",
    "mlp_reducescatter", "mlp_residual",
)
"""With sequence parallelism each all-reduce becomes an all-gather before and a reduce-scatter after."""

CORE_ATTENTION_OPS: frozenset[str] = frozenset({"attn_scores", "softmax", "attn_dropout", "attn_context"})
"""What Megatron's selective recomputation calls core attention."""

MODULE_OF: dict[str, str] = {
    "ln1": "layernorm", "ln2": "layernorm", **{n: "core_attn" for n in (*CORE_ATTENTION_OPS, "core_attn")},
    "mlp_allgather": "mlp", "fc1": "mlp", "gelu": "mlp", "fc2": "mlp",
}
"""Megatron-Core --recompute-modules membership by op name (also fills graphs stored before ops carried it)."""

DEFAULTS = {"activation": "gelu", "normalization": "layernorm", "position_embedding": "learned",
            "tie_embeddings": True, "attention": "standard", "dropout": True, "bias": "all"}


def check_model(m: ModelSpec) -> None:
    fusion.check_norm_fusion(m)
    fusion.check_kv_repeat(m)
    fusion.check_compiled(m)
    want = {"activation": "gelu", "normalization": "layernorm", "position_embedding": "learned", "bias": "all"}
    for k, v in want.items():
        if getattr(m, k) != v:
            raise SpecError(f"model {m.name!r}: family gpt has {k} {v}, got {getattr(m, k)!r} "
                            "(family mcore takes any combination Megatron-Core accepts)")
    if m.num_query_groups != m.num_attention_heads:
        raise SpecError(f"model {m.name!r}: family gpt has no grouped-query attention (num_query_groups "
                        f"{m.num_query_groups} != {m.num_attention_heads} heads); use family llama or mcore")


def check_layout(m: ModelSpec, tp: int) -> None:
    if m.num_attention_heads % tp:
        raise SpecError(f"{m.name}: {m.num_attention_heads} attention heads are not divisible by TP {tp}")
    if m.hidden_size % tp or m.ffn_hidden_size % tp:
        raise SpecError(f"{m.name}: hidden size {m.hidden_size} is not divisible by TP {tp}")


def layer(model: ModelSpec, par: ParallelSpec) -> LayerSpec:
    """The ops of one GPT layer on one TP rank."""
    b = LayerBuilder(main_grad_pass=not model.gradient_accumulation_fusion)
    s, mb, h, a, f, t = (par.seq_length, par.micro_batch_size, model.hidden_size,
                         model.num_attention_heads, model.ffn_hidden_size, par.tp)
    sp = par.sequence_parallel
    tok = s * mb // par.cp             # tokens of a micro-batch on this rank (s / CP of each sequence)
    tok_ln = tok / t if sp else tok    # tokens a rank holds outside the TP region (sharded with SP)
    hd = h // a                        # head dim
    drop_res = model.dropout and model.hidden_dropout > 0
    drop_attn = model.dropout and model.attention_dropout > 0

    # --- attention block -----------------------------------------------------------------------------
    b.elementwise("ln1", "attn", tok_ln * h, (LAYER_INPUT,), (LAYER_INPUT,), flops_per_elem=5, module="layernorm")
    qkv_in = "ln1"
    if sp:
        b.comm("attn_allgather", "attn", "gather", ACT_BYTES * tok * h, ("ln1",), ACT_BYTES * tok * h, "qkv",
               regather=True)
        qkv_in = "attn_allgather"
    # Column-parallel QKV: [tok, h] @ [h, 3h/t]. Its backward reads the LN output (with SP the sharded one,
    # re-gathered in backward as Megatron does), so the saved tensor is always "ln1".
    b.gemm("qkv", "attn", tok, h, 3 * h / t, (qkv_in,), ("ln1",))
    if model.attention == "flash":
        # Q, K, V are views of the QKV output; the op saves them, its output and the log-sum-exp.
        ctx = cp_flash_attention(b, par, mb, a / t, a / t, hd, "qkv", "qkv")
    else:
        # Q K^T per head: (b * a/t) x [s, hd] @ [hd, s]; backward reads Q and K (part of the QKV output);
        # probs @ V reads the probabilities and V.
        ctx = standard_attention(b, "qkv", "qkv", s, mb, a / t, hd, drop_attn)
    # Row-parallel projection: [tok, h/t] @ [h/t, h], partial sums reduced next.
    b.gemm("attn_proj", "attn", tok, h / t, h, (ctx,), (ctx,))
    red = _reduce(b, sp, "attn", "attn_proj", tok, tok_ln, h, "qkv")
    # Bias + dropout + residual add (fused in Megatron); backward reads only the mask.
    b.elementwise("attn_residual", "attn", tok_ln * h, (red, LAYER_INPUT), ("attn_residual",) if drop_res else (),
                  reads=2, mask=drop_res)

    # --- MLP block -----------------------------------------------------------------------------------
    b.elementwise("ln2", "mlp", tok_ln * h, ("attn_residual",), ("attn_residual",), flops_per_elem=5,
                  module="layernorm")
    fc1_in = "ln2"
    if sp:
        b.comm("mlp_allgather", "mlp", "gather", ACT_BYTES * tok * h, ("ln2",), ACT_BYTES * tok * h, "fc1",
               module="mlp", regather=True)
        fc1_in = "mlp_allgather"
    b.gemm("fc1", "mlp", tok, h, f / t, (fc1_in,), ("ln2",), module="mlp")
    b.elementwise("gelu", "mlp", tok * f / t, ("fc1",), ("fc1",), flops_per_elem=8, module="mlp")
    b.gemm("fc2", "mlp", tok, f / t, h, ("gelu",), ("gelu",), module="mlp")
    red = _reduce(b, sp, "mlp", "fc2", tok, tok_ln, h, "fc1")
    b.elementwise("mlp_residual", "mlp", tok_ln * h, (red, "attn_residual"), ("mlp_residual",) if drop_res else (),
                  reads=2, mask=drop_res)
    fusion.apply(b, model)  # the memory-bound ops a disabled fusion runs eager
    return b.spec(ACT_BYTES * tok_ln * h)


def _reduce(b: LayerBuilder, sp: bool, blk: Block, src: str, tok: float, tok_ln: float, h: float,
            wgrad_of: str) -> str:
    """The forward collective after a row-parallel GEMM: reduce-scatter with SP, else all-reduce. With SP its
    backward is an all-gather of the output gradient that the row-parallel backward waits for (exposed:
    Megatron-Core's _ReduceScatterToSequenceParallelRegion.backward gathers synchronously)."""
    if sp:
        name = f"{blk}_reducescatter"
        b.comm(name, blk, "gather", ACT_BYTES * tok * h, (src,), ACT_BYTES * tok_ln * h, "")
    else:
        name = f"{blk}_allreduce"
        b.comm(name, blk, "allreduce", ACT_BYTES * tok * h, (src,), ACT_BYTES * tok * h, wgrad_of)
    return name


def layer_params(m: ModelSpec, tp: int) -> float:
    """One layer on one TP rank: column/row-parallel weights split; LayerNorms and the row-parallel
    biases replicated (Megatron-LM's ColumnParallelLinear / RowParallelLinear)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    split = 3 * h * h + 3 * h + h * h + h * f + f + f * h
    replicated = h + h + 2 * 2 * h  # proj bias, fc2 bias, two LayerNorms (weight + bias)
    return split / tp + replicated


def embedding_params(m: ModelSpec, tp: int) -> float:
    """Vocab-parallel word embedding (split over TP) and replicated position embedding."""
    return m.vocab_size * m.hidden_size / tp + m.max_position_embeddings * m.hidden_size


def final_norm_params(m: ModelSpec) -> float:
    return 2 * m.hidden_size


def head_params(m: ModelSpec, tp: int, pp: int) -> float:
    """Final LayerNorm, and the LM head: untied, or tied with PP > 1 (Megatron keeps a copy of the word
    embedding on the last stage); tied with PP = 1 it is the first stage's embedding."""
    head = m.vocab_size * m.hidden_size / tp if (pp > 1 or not m.tie_embeddings) else 0.0
    return final_norm_params(m) + head


def output_params(m: ModelSpec) -> float:
    return 2 * m.hidden_size + (0 if m.tie_embeddings else m.vocab_size * m.hidden_size)


def matmul_flops_per_token(m: ModelSpec, s: int) -> float:
    h, f = m.hidden_size, m.ffn_hidden_size
    return 2 * (3 * h * h + h * h + 2 * h * f) + 2 * 2 * s * h  # GEMMs + attention matmuls


FAMILY = Family(
    name="gpt", defaults=DEFAULTS, check_model=check_model, check_layout=check_layout, layer=layer,
    layer_params=layer_params, embedding_params=embedding_params, head_params=head_params,
    final_norm_params=final_norm_params,
    output_params=output_params, matmul_flops_per_token=matmul_flops_per_token,
    runtime_module="lynx.runtime.layers.gpt_model",
)
