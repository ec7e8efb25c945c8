"""The general Megatron-Core decoder layer: every switch Megatron-Core's TransformerConfig has for a dense GPT
layer, independently. `family: mcore` in a model file takes the fields as given:

* attention: multi-head or grouped-query (`num_query_groups`), flash or standard;
* MLP: gated (`activation: swiglu`, Megatron's --swiglu: gate and up as one column-parallel GEMM) or not
  (`gelu`, `squared-relu`: Megatron's --squared-relu, Nemotron-4);
* normalization: `layernorm` or `rmsnorm` (--normalization);
* positions: `rope` (a rotation op on Q and K), `learned` (a table on the first stage) or `none`;
* biases: `bias: all` (Megatron's default: QKV, projection, FC1, FC2), `qkv` (--disable-bias-linear
  --add-qkv-bias, Qwen2) or `none` (--disable-bias-linear); biases change parameters, not activations;
* tied or untied embeddings, dropout.

Op names follow the LLaMA family where the structure is the same (`rmsnorm1`, `gate_up`, `swiglu`, `down`) and
the GPT family otherwise (`ln1`, `fc1`, `gelu` / `squared_relu`, `fc2`). The runtime builds one mcore layer, the
MoE layer with LLaMA attention and a shared expert (`lynx.runtime.layers.moe`); it refuses any other mcore model in
one line (planning, export and the simulator take any).
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
from lynx.families.llama import check_layout
from lynx.families.mla import mla_attention, mla_flops_per_token, mla_params
from lynx.families.moe import active_mlp_flops_per_token, expert_params, moe_mlp, router_params, shared_params
from lynx.graph import Block
from lynx.stack import LayerKind, layer_kinds, primary_kind

if TYPE_CHECKING:
    from lynx.spec import ModelSpec, ParallelSpec

DEFAULTS = {"activation": "swiglu", "normalization": "rmsnorm", "position_embedding": "rope",
            "tie_embeddings": False, "attention": "flash", "dropout": False, "bias": "none"}

ACT_FLOPS = {"gelu": 8.0, "squared-relu": 2.0}
"""FLOPs per element of the non-gated activations (tanh-approximated GeLU as gpt counts it; max + square)."""


def check_model(m: ModelSpec) -> None:
    """Every combination ModelSpec accepts is a Megatron-Core layer, except the ones lynx does not model."""
    fusion.check_norm_fusion(m)
    fusion.check_kv_repeat(m)
    fusion.check_compiled(m)
    if m.multi_latent_attention and m.q_lora_rank == 0:
        raise SpecError(f"model {m.name!r}: multi_latent_attention with q_lora_rank 0 (a direct Q projection, "
                        "DeepSeek-V2-Lite) is not modelled; valid: q_lora_rank > 0")
    if m.multi_latent_attention and m.attention != "flash":
        raise SpecError(f"model {m.name!r}: multi_latent_attention is modelled with flash attention only; "
                        "valid: attention flash")


def _norm(b: LayerBuilder, m: ModelSpec, idx: int, blk: Block, elems: float, src: str) -> str:
    name = f"rmsnorm{idx}" if m.normalization == "rmsnorm" else f"ln{idx}"
    b.elementwise(name, blk, elems, (src,), (src,), flops_per_elem=4 if m.normalization == "rmsnorm" else 5,
                  module="layernorm")
    return name


def _gather(b: LayerBuilder, sp: bool, blk: Block, src: str, tok: float, h: float, gemm: str, module: str) -> str:
    if not sp:
        return src
    name = f"{blk}_allgather"
    b.comm(name, blk, "gather", ACT_BYTES * tok * h, (src,), ACT_BYTES * tok * h, gemm, module=module,
           regather=True)
    return name


def _reduce(b: LayerBuilder, sp: bool, blk: Block, src: str, tok: float, tok_ln: float, h: float, wgrad: str) -> str:
    if sp:
        name = f"{blk}_reducescatter"
        b.comm(name, blk, "gather", ACT_BYTES * tok * h, (src,), ACT_BYTES * tok_ln * h, "")
    else:
        name = f"{blk}_allreduce"
        b.comm(name, blk, "allreduce", ACT_BYTES * tok * h, (src,), ACT_BYTES * tok * h, wgrad)
    return name


def _attention(b: LayerBuilder, m: ModelSpec, par: ParallelSpec, tok: float, tok_ln: float) -> str:
    s, mb, h, t, d = par.seq_length, par.micro_batch_size, m.hidden_size, par.tp, m.head_dim
    a_l, g_l = m.num_attention_heads / t, m.num_query_groups / t
    sp = par.sequence_parallel
    n1 = _norm(b, m, 1, "attn", tok_ln * h, LAYER_INPUT)
    if m.multi_latent_attention:
        return _reduce(b, sp, "attn", mla_attention(b, m, par, n1, tok, tok_ln), tok, tok_ln, h, "kv_up")
    b.gemm("qkv", "attn", tok, h, (a_l + 2 * g_l) * d, (_gather(b, sp, "attn", n1, tok, h, "qkv", ""),), (n1,))
    qk = "qkv"
    if m.qk_layernorm:  # --qk-layernorm: a norm over every query and key head (Qwen3)
        b.elementwise("qk_layernorm", "attn", tok * (a_l + g_l) * d, ("qkv",), ("qkv",), flops_per_elem=4,
                      module="layernorm")
        qk = "qk_layernorm"
    if m.position_embedding == "rope":
        b.elementwise("rope", "attn", tok * (a_l + g_l) * d, (qk,), (), flops_per_elem=3)
        qk = "rope"
    if m.attention == "flash":
        ctx = cp_flash_attention(b, par, mb, a_l, g_l, d, qk, "qkv")
    else:
        ctx = standard_attention(b, qk, "qkv", s, mb, a_l, d, m.dropout and m.attention_dropout > 0)
    b.gemm("attn_proj", "attn", tok, a_l * d, h, (ctx,), (ctx,))
    return _reduce(b, sp, "attn", "attn_proj", tok, tok_ln, h, "qkv")


def _mlp(b: LayerBuilder, m: ModelSpec, par: ParallelSpec, tok: float, tok_ln: float, kind: LayerKind
         ) -> tuple[str, ...]:
    h, f, t, sp = m.hidden_size, m.ffn_hidden_size, par.tp, par.sequence_parallel
    gated = m.activation == "swiglu"
    up, act, down = ("gate_up", "swiglu", "down") if gated else ("fc1", m.activation.replace("-", "_"), "fc2")
    n2 = _norm(b, m, 2, "mlp", tok_ln * h, "attn_residual")
    if kind == "moe":
        return moe_mlp(b, m, par, n2, tok, tok_ln)
    b.gemm(up, "mlp", tok, h, (2 if gated else 1) * f / t, (_gather(b, sp, "mlp", n2, tok, h, up, "mlp"),), (n2,),
           module="mlp")
    if gated:  # fused SwiGLU: [tok, 2f/t] -> [tok, f/t], backward reads its input
        b.elementwise(act, "mlp", tok * 2 * f / t, (up,), (up,), flops_per_elem=3, out_elems=tok * f / t,
                      module="mlp")
    else:
        b.elementwise(act, "mlp", tok * f / t, (up,), (up,), flops_per_elem=ACT_FLOPS[m.activation], module="mlp")
    b.gemm(down, "mlp", tok, f / t, h, (act,), (act,), module="mlp")
    return (_reduce(b, sp, "mlp", down, tok, tok_ln, h, up),)


def layer(m: ModelSpec, par: ParallelSpec) -> LayerSpec:
    """The ops of one Megatron-Core layer on one TP rank, of the kind most of the model's layers have."""
    return kind_layer(m, par, primary_kind(m))


def kind_layer(m: ModelSpec, par: ParallelSpec, kind: LayerKind) -> LayerSpec:
    """The ops of one Megatron-Core layer of `kind` (dense or MoE, `lynx.stack`) on one rank."""
    b = LayerBuilder(main_grad_pass=not m.gradient_accumulation_fusion)
    tok = par.seq_length * par.micro_batch_size // par.cp  # s / CP tokens of each sequence on this rank
    tok_ln = tok / par.tp if par.sequence_parallel else tok
    h = m.hidden_size
    drop = m.dropout and m.hidden_dropout > 0
    red = _attention(b, m, par, tok, tok_ln)
    b.elementwise("attn_residual", "attn", tok_ln * h, (red, LAYER_INPUT), ("attn_residual",) if drop else (),
                  reads=2, mask=drop)
    reds = _mlp(b, m, par, tok, tok_ln, kind)
    b.elementwise("mlp_residual", "mlp", tok_ln * h, (*reds, "attn_residual"), ("mlp_residual",) if drop else (),
                  reads=1 + len(reds), mask=drop)
    fusion.apply(b, m)  # the memory-bound ops a disabled fusion runs eager
    return b.spec(ACT_BYTES * tok_ln * h)


def _norm_params(m: ModelSpec) -> float:
    return (1 if m.normalization == "rmsnorm" else 2) * m.hidden_size


def layer_params(m: ModelSpec, tp: int) -> float:
    """One layer of the model's primary kind on a TP rank, routed experts divided by TP too (the per-rank count
    with EP is `kind_params` plus `moe.expert_params` / (EP x ETP), `cost.static_memory`)."""
    kind = primary_kind(m)
    return kind_params(m, tp, kind) + (expert_params(m) / tp if kind == "moe" else 0.0)


def kind_params(m: ModelSpec, tp: int, kind: LayerKind) -> float:
    """A layer of `kind` on a TP rank without its routed experts. Column-parallel QKV and FC1 (gate/up),
    row-parallel projection and FC2 split over TP with their biases; the row-parallel biases and the two norms
    replicated; an MoE layer's MLP is its router (replicated) and shared expert (split over TP)."""
    h, a, g, f, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size, m.head_dim
    up = 2 * f if m.activation == "swiglu" else f
    mlp = h * up + f * h if kind == "dense" else shared_params(m)
    attn = 0.0 if m.multi_latent_attention else h * (a + 2 * g) * d + a * d * h
    split = attn + mlp
    replicated = 2 * _norm_params(m) + (router_params(m) if kind == "moe" else 0.0)
    if m.multi_latent_attention:
        replicated += mla_params(m, tp)  # already per TP rank
    if m.qk_layernorm:
        replicated += 2 * d
    if m.bias in ("all", "qkv") and not m.multi_latent_attention:
        split += (a + 2 * g) * d
    if m.bias == "all" and kind == "dense":
        split += up
        replicated += 2 * h
    return split / tp + replicated


def embedding_params(m: ModelSpec, tp: int) -> float:
    pos = m.max_position_embeddings * m.hidden_size if m.position_embedding == "learned" else 0
    return m.vocab_size * m.hidden_size / tp + pos


def final_norm_params(m: ModelSpec) -> float:
    return _norm_params(m)


def head_params(m: ModelSpec, tp: int, pp: int) -> float:
    head = m.vocab_size * m.hidden_size / tp if (pp > 1 or not m.tie_embeddings) else 0.0
    return final_norm_params(m) + head


def output_params(m: ModelSpec) -> float:
    return final_norm_params(m) + (0 if m.tie_embeddings else m.vocab_size * m.hidden_size)


def matmul_flops_per_token(m: ModelSpec, s: int) -> float:
    """Per layer, averaged over the model's kinds (MoE layers count the top-k experts a token runs through)."""
    h, a, g, f, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size, m.head_dim
    up = 3 if m.activation == "swiglu" else 2
    attn = mla_flops_per_token(m, s) if m.multi_latent_attention else 2 * (h * (a + 2 * g) * d + a * d * h) \
        + 2 * 2 * s * a * d
    kinds = layer_kinds(m)
    n_moe = sum(k == "moe" for k in kinds)
    mlp = ((len(kinds) - n_moe) * 2 * up * h * f + n_moe * active_mlp_flops_per_token(m)) / len(kinds)
    return attn + mlp


FAMILY = Family(
    name="mcore", defaults=DEFAULTS, check_model=check_model, check_layout=check_layout, layer=layer,
    layer_params=layer_params, embedding_params=embedding_params, head_params=head_params,
    final_norm_params=final_norm_params, output_params=output_params,
    matmul_flops_per_token=matmul_flops_per_token, runtime_module="lynx.runtime.layers.moe",
    kind_layer=kind_layer,
)
