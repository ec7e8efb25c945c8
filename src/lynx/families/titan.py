"""torchtitan's Llama 3 block as it runs in eager mode: the family ``torchtitan-llama3``.

The shapes, parameters and tensor-parallel split are LLaMA's (`lynx.families.llama`); what differs is what
the kernels keep for backward. torchtitan 0.3.0's ``Llama3TransformerBlock`` (torchtitan/models/llama3/model.py,
its attention and feed-forward in torchtitan/models/common/) runs unfused PyTorch ops, and
``tests/unit/test_export_torchtitan_bytes.py`` measures them with ``saved_tensors_hooks`` on CPU, counting each storage
once (the CPU build runs ``nn.RMSNorm`` as the eager composite, so that test plans ``norm_fusion: false``). Per
token of one block (h hidden, a/g query/KV heads of d, f the FFN width, all on one TP rank):

==============  ===================================================  ==========================================
op              what backward keeps (torchtitan eager)                Megatron-Core + TE (`families.llama`)
==============  ===================================================  ==========================================
rmsnorm1/2      on CUDA torch's fused kernel (torch >= 2.8): the      the 16-bit input (2h)
                16-bit input (2h). ``norm_fusion: false`` (the CPU
                build, older torch): the fp32 input (4h), the fp32
                normalized input (4h), fp32 1/rms (4) and the
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

The layer input is not kept by an eager block without checkpointing (the eager norm keeps its fp32 copy
instead); lynx keeps it anyway, as the checkpoint every policy keeps (`lynx.graph`), so the priced ``none`` layer
is one 16-bit [tokens, h] above the measurement. torchtitan's sequence parallelism (DTensor ``SequenceParallel``
norms, ``PrepareModuleInput`` gathering before ``wqkv`` / ``w1`` / ``w3``) keeps the gathered GEMM input, not
the shard (Megatron regathers it in backward).

``kv_repeat`` (decision 0263) describes torchtitan's attention as it ran through early 2025 (the 2024 runs of
benchmarks/fsdp_published.py): ``wq``, ``wk``, ``wv`` as three GEMMs whose outputs are viewed as heads (no copies),
the same complex RoPE on Q (op ``rope``) and on K (``k_rope``), and ``repeat_kv`` copying K and V to every query
head (ops ``k_repeat``, ``v_repeat``; none when the heads are equal). Attention then runs over a heads of K and V
and keeps the copies: per token 2 a d each for K and V where 0.3.0 keeps 2 g d, and not the rotated K.

Times are the eager kernels' own (decision 0262): each memory-bound op's bytes read and written and its kernel
count, measured against the block's aten ops on CPU (tests/unit/test_eager_traffic.py; the constants below).
With ``compiled`` (torchtitan's ``--compile.enable``, decision 0268) each memory-bound op is one fused kernel at
the traffic a fused kernel moves (its reads and its write once), the norm is fused, SiLU and the product are one
kernel keeping the two GEMM outputs, and the input-gradient sums go into the norms' backward; what else
backward keeps is the eager block's (the partitioner may keep less: not modelled). The kernel counts are an
upper bound (inductor also fuses neighbours, a residual add with the next norm).

Static memory is torchtitan's FSDP2 as torchtitan runs it (`lynx.cost.titan_fsdp`): sharded fp32 parameters,
gradients and AdamW state, the bf16 parameters it all-gathers (kept through the step with a pipeline), not
Megatron's buffers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from lynx.errors import SpecError
from lynx.families import fusion, llama
from lynx.families.base import ACT_BYTES, LAYER_INPUT, Family, LayerBuilder, LayerSpec, Passes
from lynx.graph import Block

if TYPE_CHECKING:
    from lynx.spec import ModelSpec, ParallelSpec

NAME = "torchtitan-llama3"

ROPE = Passes(fwd=12, bwd=12, fwd_kernels=8, bwd_kernels=8)
"""Per element of Q and K: ``FusedQKVLinear``'s clones of q and k (2), then torchtitan's complex RoPE for each
(the fp32 copy 3, the complex product 4, the cast back 3); backward the same three kernels per tensor, the
frequency table's clone, and its share of the gradient's ``cat`` back into the fused layout (2). Measured with
the other constants here (tests/unit/test_eager_traffic.py)."""
V_COPY = Passes(fwd=2, bwd=2, fwd_kernels=1, bwd_kernels=1)
"""V's clone out of the fused QKV output; backward its share of the ``cat`` (the kernel counted here)."""
SILU = Passes(fwd=2, bwd=3, fwd_kernels=1, bwd_kernels=1)
SWIGLU_PRODUCT = Passes(fwd=3, bwd=6, fwd_kernels=1, bwd_kernels=2)
"""``silu(w1 x) * w3 x`` in FeedForward: the product's two gradients, each reading two tensors."""
RESIDUAL = Passes(fwd=3, bwd=3, fwd_kernels=1, bwd_kernels=1)
"""``x + out``; backward the gradient summed where the residual stream forks (the block input feeds the norm and
the residual, and so does h)."""
FFN_INPUT_GRAD_SUM = 3.0
"""w1 and w3 read the same input: backward sums their two input gradients (one kernel, elements of the GEMM
input), counted with rmsnorm2's backward."""

# torchtitan's 2024 attention (`ModelSpec.kv_repeat`, decision 0263), measured as the constants above.
ROPE_2024 = Passes(fwd=10, bwd=10, fwd_kernels=3, bwd_kernels=4)
"""Per element of Q (op ``rope``) or K (``k_rope``), the 2024 attention's complex RoPE on the ``wq`` / ``wk``
outputs with no copy before it: the fp32 copy (3), the complex product (4), the cast back (3); backward the same
three and the frequency table's conjugate made real (a clone over s x d/2 values, a kernel and no bytes to
speak of)."""
QKV_INPUT_GRAD_SUM = 6.0
"""wq, wk and wv read the same input: backward sums their three input gradients (two adds, elements of the GEMM
input), counted with rmsnorm1's backward."""


def kv_repeat_passes(n_rep: float) -> Passes:
    """``repeat_kv`` for K or V, per element of its output (n_rep copies of each K/V head): forward an
    unsqueeze-expand view and ``reshape``'s copy, which reads the expanded view (counted at its size, as every
    measured constant counts a broadcast operand: the GPU's cache serves the repeats) and writes the copy; backward
    the gradient summed over the repeats (reads it, writes 1/n_rep of it). One kernel each way."""
    return Passes(fwd=2, bwd=1 + 1 / n_rep, fwd_kernels=1, bwd_kernels=1)


def _norm(b: LayerBuilder, name: str, block: Block, tok: float, h: float, src: str, fused: bool) -> None:
    """RMSNorm: torch's ``_fused_rms_norm`` on CUDA (one kernel each way, keeps its 16-bit input), or the eager
    fp32 composite (`fusion.RMSNORM_EAGER`: the CPU build, torch before 2.8, torchtitan's own 2024 RMSNorm), which
    keeps the fp32 input and normalized input and fp32 1/rms (measured, see the docstring)."""
    b.elementwise(name, block, tok * h, (src,), (src,), flops_per_elem=4, module="layernorm")
    if not fused:
        fusion.eager_rmsnorm(b, name, tok, h)


def _more_backward(b: LayerBuilder, name: str, nbytes: float, kernels: int) -> None:
    if isinstance(b, _Compiled):
        return
    i = next(j for j, o in enumerate(b.ops) if o.name == name)
    o = b.ops[i]
    base = o.bwd_mem_bytes if o.bwd_mem_bytes is not None else o.bwd_factor * o.mem_bytes
    b.ops[i] = replace(o, bwd_mem_bytes=base + nbytes,
                       bwd_kernels=(o.bwd_kernels if o.bwd_mem_bytes is not None else 1) + kernels)


def _attention_2024(b: LayerBuilder, x: str, tok: float, mb: float, s: float, h: float, a_l: float, g_l: float,
                    d: float) -> None:
    """torchtitan's attention through early 2025 (`ModelSpec.kv_repeat`): ``wq``, ``wk``, ``wv`` apart (their
    outputs viewed as heads, no copies), RoPE on Q and on K, ``repeat_kv`` copying K and V to every query head
    (none when the heads are equal), and attention over a heads of K and V, which it keeps for backward (the
    repeated copies, or ``wv``'s output itself when nothing is repeated)."""
    n_rep = a_l / g_l
    b.gemm("wq", "attn", tok, h, a_l * d, (x,), (x,))
    b.gemm("wk", "attn", tok, h, g_l * d, (x,), (x,))
    b.gemm("wv", "attn", tok, h, g_l * d, (x,), (x,))
    _more_backward(b, "rmsnorm1", ACT_BYTES * QKV_INPUT_GRAD_SUM * tok * h, 2)
    b.elementwise("rope", "attn", tok * a_l * d, ("wq",), (), flops_per_elem=3)
    b.eager("rope", ROPE_2024, tok * a_l * d)
    b.elementwise("k_rope", "attn", tok * g_l * d, ("wk",), (), flops_per_elem=3)
    b.eager("k_rope", ROPE_2024, tok * g_l * d)
    k, v = "k_rope", "wv"
    if n_rep > 1:
        for name, src in (("k_repeat", k), ("v_repeat", v)):
            b.elementwise(name, "attn", tok * a_l * d, (src,), ())
            b.eager(name, kv_repeat_passes(n_rep), tok * a_l * d)
        k, v = "k_repeat", "v_repeat"
    b.flash_attention("core_attn", "attn", mb * a_l, mb * a_l if n_rep > 1 else mb * g_l, s, d, ("rope", k, v),
                      ("rope", k, v, "core_attn"))


class _Compiled(LayerBuilder):
    """The block under torch.compile (`ModelSpec.compiled`): every memory-bound op one fused kernel at its fused
    traffic (the builder's `elementwise`), the eager re-descriptions and the input-gradient sums (fused into the
    norm's backward) dropped."""

    def eager(self, name: str, passes: Passes, elems: float) -> None:
        return None


def check_model(m: ModelSpec) -> None:
    llama.check_fields(m)
    if m.attention != "flash":
        raise SpecError(f"model {m.name!r}: family {NAME} runs torchtitan's fused attention; attention must be "
                        f"flash, got {m.attention!r}")
    if m.dropout:
        raise SpecError(f"model {m.name!r}: torchtitan's Llama 3 block has no dropout (family {NAME})")


def layer(model: ModelSpec, par: ParallelSpec) -> LayerSpec:
    """The ops of one torchtitan Llama 3 block on one TP rank, eager kernels."""
    if par.cp > 1:
        raise SpecError(f"family {NAME}: context parallelism is not modelled for torchtitan's block (CP {par.cp})")
    b = _Compiled() if model.compiled else LayerBuilder()
    s, mb, h, a, g, f, t = (par.seq_length, par.micro_batch_size, model.hidden_size, model.num_attention_heads,
                            model.num_query_groups, model.ffn_hidden_size, par.tp)
    sp = par.sequence_parallel
    tok = s * mb
    tok_ln = tok / t if sp else tok
    d = model.head_dim
    a_l, g_l = a / t, g / t

    fused = model.norm_fusion or model.compiled  # inductor fuses the eager norm too
    _norm(b, "rmsnorm1", "attn", tok_ln, h, LAYER_INPUT, fused)
    qkv_in = "rmsnorm1"
    if sp:
        b.comm("attn_allgather", "attn", "gather", ACT_BYTES * tok * h, ("rmsnorm1",), ACT_BYTES * tok * h,
               "wq" if model.kv_repeat else "qkv")
        qkv_in = "attn_allgather"
    if model.kv_repeat:
        _attention_2024(b, qkv_in, tok, mb, s, h, a_l, g_l, d)
    else:
        b.gemm("qkv", "attn", tok, h, (a_l + 2 * g_l) * d, (qkv_in,), (qkv_in,))
        # q, k, v split out of the fused output and made contiguous; only V's copy is read by backward.
        b.elementwise("v_copy", "attn", tok * g_l * d, ("qkv",), ())
        b.eager("v_copy", V_COPY, tok * g_l * d)
        b.elementwise("rope", "attn", tok * (a_l + g_l) * d, ("qkv",), (), flops_per_elem=3)
        b.eager("rope", ROPE, tok * (a_l + g_l) * d)
        b.flash_attention("core_attn", "attn", mb * a_l, mb * g_l, s, d, ("rope", "v_copy"),
                          ("rope", "v_copy", "core_attn"))
    b.gemm("attn_proj", "attn", tok, a_l * d, h, ("core_attn",), ("core_attn",))
    red = "attn_reducescatter" if sp else "attn_allreduce"
    if sp:
        b.comm(red, "attn", "gather", ACT_BYTES * tok * h, ("attn_proj",), ACT_BYTES * tok_ln * h, "")
    else:
        b.comm(red, "attn", "allreduce", ACT_BYTES * tok * h, ("attn_proj",), ACT_BYTES * tok * h,
               "wq" if model.kv_repeat else "qkv")
    b.elementwise("attn_residual", "attn", tok_ln * h, (red, LAYER_INPUT), (), reads=2)
    b.eager("attn_residual", RESIDUAL, tok_ln * h)

    _norm(b, "rmsnorm2", "mlp", tok_ln, h, "attn_residual", fused)
    _more_backward(b, "rmsnorm2", ACT_BYTES * FFN_INPUT_GRAD_SUM * tok * h, 1)
    up_in = "rmsnorm2"
    if sp:
        b.comm("mlp_allgather", "mlp", "gather", ACT_BYTES * tok * h, ("rmsnorm2",), ACT_BYTES * tok * h, "gate",
               module="mlp")
        up_in = "mlp_allgather"
    b.gemm("gate", "mlp", tok, h, f / t, (up_in,), (up_in,), module="mlp")
    b.gemm("up", "mlp", tok, h, f / t, (up_in,), (up_in,), module="mlp")
    if model.compiled:  # one kernel: silu(w1 x) * w3 x, keeping the two GEMM outputs (SiLU recomputed in it)
        b.elementwise("swiglu", "mlp", tok * f / t, ("gate", "up"), ("gate", "up"), reads=2, flops_per_elem=4,
                      module="mlp")
    else:
        b.elementwise("silu", "mlp", tok * f / t, ("gate",), ("gate",), flops_per_elem=3, module="mlp")
        b.eager("silu", SILU, tok * f / t)
        b.elementwise("swiglu", "mlp", tok * f / t, ("silu", "up"), ("silu", "up"), reads=2, module="mlp")
        b.eager("swiglu", SWIGLU_PRODUCT, tok * f / t)
    b.gemm("down", "mlp", tok, f / t, h, ("swiglu",), ("swiglu",), module="mlp")
    red = "mlp_reducescatter" if sp else "mlp_allreduce"
    if sp:
        b.comm(red, "mlp", "gather", ACT_BYTES * tok * h, ("down",), ACT_BYTES * tok_ln * h, "")
    else:
        b.comm(red, "mlp", "allreduce", ACT_BYTES * tok * h, ("down",), ACT_BYTES * tok * h, "gate")
    b.elementwise("mlp_residual", "mlp", tok_ln * h, (red, "attn_residual"), (), reads=2)
    b.eager("mlp_residual", RESIDUAL, tok_ln * h)
    return b.spec(ACT_BYTES * tok_ln * h)


FAMILY = Family(
    name=NAME, defaults=llama.DEFAULTS, check_model=check_model, check_layout=llama.check_layout, layer=layer,
    layer_params=llama.layer_params, embedding_params=llama.embedding_params, head_params=llama.head_params,
    final_norm_params=llama.final_norm_params, output_params=llama.output_params,
    matmul_flops_per_token=llama.matmul_flops_per_token,
    runtime_module="",  # lynx's runtime does not build it: torchtitan runs it (lynx.integrations.torchtitan)
    static_memory="torchtitan-fsdp",  # torchtitan's FSDP as it runs (`lynx.cost.titan_fsdp`)
)
