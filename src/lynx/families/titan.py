"""torchtitan's Llama 3 block as it runs in eager mode: the family ``torchtitan-llama3``.

The shapes, parameters and tensor-parallel split are LLaMA's (`lynx.families.llama`); what differs is what
the kernels keep for backward. torchtitan 0.3.0's ``Llama3TransformerBlock`` (torchtitan/models/llama3/model.py,
its attention and feed-forward in torchtitan/models/common/) runs unfused PyTorch ops, and
``tests/unit/test_titan_family.py`` measures them with ``saved_tensors_hooks`` on CPU, counting each storage
once. Per token of one block (h hidden, a/g query/KV heads of d, f the FFN width, all on one TP rank):

==============  ===================================================  ==========================================
op              what backward keeps (torchtitan eager)                Megatron-Core + TE (`families.llama`)
==============  ===================================================  ==========================================
rmsnorm1/2      ``nn.RMSNorm`` upcasts: the fp32 input (4h), the      the 16-bit input (2h)
                fp32 normalized input (4h), fp32 1/rms (4) and the
                16-bit output the next GEMM saves (2h)
qkv             output not kept: ``FusedQKVLinear`` copies q, k, v    the whole QKV output (V is a view of it)
                out of it with ``.contiguous()``
v_copy          the V copy (2 g d), read by attention                 -
rope            rotated Q and K (2 (a + g) d)                         the same
core_attn       output (2 a d) and fp32 log-sum-exp (4 a)             the same
gate, up        ``w1`` and ``w3`` outputs (2 f each)                  one fused gate_up output (4f)
silu            ``silu(w1 x)`` (2f), read by the product              - (fused into swiglu)
swiglu          the product (2f), read by ``w2``                      the fused SwiGLU output (2f)
==============  ===================================================  ==========================================

The layer input is not kept by an eager block without checkpointing (the norm keeps its fp32 copy instead);
lynx keeps it anyway, as the checkpoint every policy keeps (`lynx.graph`), so the priced ``none`` layer is one
16-bit [tokens, h] above the measurement. torchtitan's sequence parallelism (DTensor ``SequenceParallel``
norms, ``PrepareModuleInput`` gathering before ``wqkv`` / ``w1`` / ``w3``) keeps the gathered GEMM input, not
the shard (Megatron regathers it in backward). Times are priced as for LLaMA's ops; only the memory is
measured. The compiled block (``torch.compile``, fused norm and SwiGLU) is not modelled here.

Static memory is torchtitan's FSDP2 as torchtitan runs it (`lynx.cost.titan_fsdp`): sharded fp32 parameters,
gradients and AdamW state, the bf16 parameters it all-gathers (kept through the step with a pipeline), not
Megatron's buffers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from lynx.errors import SpecError
from lynx.families import llama
from lynx.families.base import ACT_BYTES, LAYER_INPUT, Family, LayerBuilder, LayerSpec
from lynx.graph import Block

if TYPE_CHECKING:
    from lynx.spec import ModelSpec, ParallelSpec

NAME = "torchtitan-llama3"
FP32_BYTES = 4.0
"""``nn.RMSNorm`` on 16-bit input computes in fp32 and keeps fp32 tensors (measured, see the docstring)."""


def _norm(b: LayerBuilder, name: str, block: Block, tok: float, h: float, src: str) -> None:
    """Eager RMSNorm: 16-bit output plus its fp32 side state (upcast input, normalized input, 1/rms)."""
    b.elementwise(name, block, tok * h, (src,), (name,), flops_per_elem=4,
                  module="layernorm")
    last = b.ops[-1]
    b.ops[-1] = replace(last, mask_bytes=2 * FP32_BYTES * tok * h + FP32_BYTES * tok)


def check_model(m: ModelSpec) -> None:
    llama.check_model(m)
    if m.attention != "flash":
        raise SpecError(f"model {m.name!r}: family {NAME} runs torchtitan's fused attention; attention must be "
                        f"flash, got {m.attention!r}")
    if m.dropout:
        raise SpecError(f"model {m.name!r}: torchtitan's Llama 3 block has no dropout (family {NAME})")


def layer(model: ModelSpec, par: ParallelSpec) -> LayerSpec:
    """The ops of one torchtitan Llama 3 block on one TP rank, eager kernels."""
    if par.cp > 1:
        raise SpecError(f"family {NAME}: context parallelism is not modelled for torchtitan's block (CP {par.cp})")
    b = LayerBuilder()
    s, mb, h, a, g, f, t = (par.seq_length, par.micro_batch_size, model.hidden_size, model.num_attention_heads,
                            model.num_query_groups, model.ffn_hidden_size, par.tp)
    sp = par.sequence_parallel
    tok = s * mb
    tok_ln = tok / t if sp else tok
    d = model.head_dim
    a_l, g_l = a / t, g / t

    _norm(b, "rmsnorm1", "attn", tok_ln, h, LAYER_INPUT)
    qkv_in = "rmsnorm1"
    if sp:
        b.comm("attn_allgather", "attn", "gather", ACT_BYTES * tok * h, ("rmsnorm1",), ACT_BYTES * tok * h, "qkv")
        qkv_in = "attn_allgather"
    b.gemm("qkv", "attn", tok, h, (a_l + 2 * g_l) * d, (qkv_in,), (qkv_in,))
    # q, k, v split out of the fused output and made contiguous; only V's copy is read by backward.
    b.elementwise("v_copy", "attn", tok * g_l * d, ("qkv",), ())
    b.elementwise("rope", "attn", tok * (a_l + g_l) * d, ("qkv",), (), flops_per_elem=3)
    b.flash_attention("core_attn", "attn", mb * a_l, mb * g_l, s, d, ("rope", "v_copy"),
                      ("rope", "v_copy", "core_attn"))
    b.gemm("attn_proj", "attn", tok, a_l * d, h, ("core_attn",), ("core_attn",))
    red = "attn_reducescatter" if sp else "attn_allreduce"
    if sp:
        b.comm(red, "attn", "gather", ACT_BYTES * tok * h, ("attn_proj",), ACT_BYTES * tok_ln * h, "")
    else:
        b.comm(red, "attn", "allreduce", ACT_BYTES * tok * h, ("attn_proj",), ACT_BYTES * tok * h, "qkv")
    b.elementwise("attn_residual", "attn", tok_ln * h, (red, LAYER_INPUT), (), reads=2)

    _norm(b, "rmsnorm2", "mlp", tok_ln, h, "attn_residual")
    up_in = "rmsnorm2"
    if sp:
        b.comm("mlp_allgather", "mlp", "gather", ACT_BYTES * tok * h, ("rmsnorm2",), ACT_BYTES * tok * h, "gate",
               module="mlp")
        up_in = "mlp_allgather"
    b.gemm("gate", "mlp", tok, h, f / t, (up_in,), (up_in,), module="mlp")
    b.gemm("up", "mlp", tok, h, f / t, (up_in,), (up_in,), module="mlp")
    b.elementwise("silu", "mlp", tok * f / t, ("gate",), ("gate",), flops_per_elem=3, module="mlp")
    b.elementwise("swiglu", "mlp", tok * f / t, ("silu", "up"), ("silu", "up"), reads=2, module="mlp")
    b.gemm("down", "mlp", tok, f / t, h, ("swiglu",), ("swiglu",), module="mlp")
    red = "mlp_reducescatter" if sp else "mlp_allreduce"
    if sp:
        b.comm(red, "mlp", "gather", ACT_BYTES * tok * h, ("down",), ACT_BYTES * tok_ln * h, "")
    else:
        b.comm(red, "mlp", "allreduce", ACT_BYTES * tok * h, ("down",), ACT_BYTES * tok * h, "gate")
    b.elementwise("mlp_residual", "mlp", tok_ln * h, (red, "attn_residual"), (), reads=2)
    return b.spec(ACT_BYTES * tok_ln * h)


FAMILY = Family(
    name=NAME, defaults=llama.DEFAULTS, check_model=check_model, check_layout=llama.check_layout, layer=layer,
    layer_params=llama.layer_params, embedding_params=llama.embedding_params, head_params=llama.head_params,
    final_norm_params=llama.final_norm_params, output_params=llama.output_params,
    matmul_flops_per_token=llama.matmul_flops_per_token,
    runtime_module="",  # lynx's runtime does not build it: torchtitan runs it (lynx.integrations.torchtitan)
    static_memory="torchtitan-fsdp",  # torchtitan's FSDP as it runs (`lynx.cost.titan_fsdp`)
)
