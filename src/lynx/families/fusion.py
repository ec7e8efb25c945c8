"""Fused (TransformerEngine / Megatron-Core's fusions, the default) versus eager memory-bound ops.

A family describes each memory-bound op as Megatron-Core runs it by default: one fused kernel (TE's fused RoPE,
Megatron's jit-fused bias-SwiGLU / bias-GeLU / bias-dropout-add, the fused causal masked softmax). With a fusion
switched off (ModelSpec's fields, Megatron's `--no-*-fusion` flags) Megatron-Core runs the eager PyTorch code of
the same module; `apply` re-describes those ops by the kernels that code launches. Counts are elements read plus
written, in units of the op's size n (16-bit), from the code each comment names (Megatron-Core 0.16, the
version installed here); what autograd saves is read off the same code (which tensors each eager op's backward
holds).

| op (n) | fused, fwd / bwd | eager, fwd / bwd, kernels | saved besides the output |
|---|---|---|---|
| swiglu (tok f/t) | 3 / 5, 1 / 1 | 5 / 13, 2 / 4 | silu(gate), n |
| gelu after a bias (tok f/t) | 2 / 3, 1 / 1 | 4 / 4, 2 / 2 | nothing |
| softmax (b a/t s^2) | 2 / 3, 1 / 1 | 4 / 5, 2 / 2 | nothing (the causal mask is shared) |
| residual, bias and dropout (tok h) | 3 / 2 | 7 / 3, 3 / 2 | nothing (dropout's mask, as fused) |
| residual, dropout, no bias | 3 / 2 | 5 / 2, 2 / 1 | nothing |
| residual, bias, no dropout | 3 / 1 | 5 / 1, 2 / 1 | nothing |
| rope (tok (a+g)/t d) | 2 / 2 | 10 / 10, 10 / 10 | nothing (cos, sin are buffers) |
| RMSNorm (tok h), norm_fusion False | 2 / 4 | 20 / 54, 8 / 17 (measured) | fp32 input and normalized input |

The fused column is what lynx prices without change (its backward is `BWD_MEMORY_FACTOR` x the forward, within
a pass of the kernels' own counts); nothing here moves a default plan.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lynx.errors import SpecError
from lynx.families.base import ACT_BYTES, LayerBuilder, Passes
from lynx.fp8 import Fp8Engine

if TYPE_CHECKING:
    from lynx.spec import ModelSpec

SWIGLU_EAGER = Passes(fwd=5, bwd=13, fwd_kernels=2, bwd_kernels=4, saved=1)
"""megatron/core/transformer/mlp.py `glu` without bias_activation_fusion: ``x = torch.chunk(x, 2, -1);
F.silu(x[0]) * x[1]``. Forward: silu reads the gate and writes n, the product reads silu and up and writes n
(1 + 1 + 2 + 1). Backward: the product's two gradients (2 + 1 each), silu's backward (gate and gradient, writes
n), and chunk's backward concatenating the two halves (reads 2n, writes 2n): 6 + 3 + 4. The product saves
silu(gate), a new n-element tensor (gate and up are views of the FC1 output, saved anyway). Fused
(fused_bias_swiglu.py, one kernel each way, saves only its input): 3 / 5."""

GELU_BIAS_EAGER = Passes(fwd=4, bwd=4, fwd_kernels=2, bwd_kernels=2)
"""mlp.py without bias_activation_fusion and with an FC1 bias: ``intermediate + bias`` (reads n, writes n), then
``F.gelu`` (reads n, writes n); backward gelu's (reads input and gradient, writes n) and the bias gradient's
reduction (reads n). GeLU saves the biased input, which replaces the raw FC1 output no one else saves: no extra
memory. Fused (fused_bias_gelu.py, bias_gelu_impl): 2 / 3. Without a bias Megatron turns the fusion off itself
(megatron/training/arguments.py: "Disable bias gelu fusion if we are disabling bias altogether") and the eager
F.gelu is one kernel, as lynx prices it."""

SOFTMAX_EAGER = Passes(fwd=4, bwd=5, fwd_kernels=2, bwd_kernels=2)
"""fused_softmax.py FusedScaleMaskSoftmax.forward_torch_softmax without masked_softmax_fusion: the mask in place
(``attention_mask_func``: ``masked_fill_``, reads n, writes n) and ``torch.nn.Softmax`` (reads n, writes n); no
scale pass (the 1/sqrt(d) is in the scores' baddbmm unless query-key layer scaling is on) and no fp32 cast
(--attention-softmax-in-fp32 is off by default). Backward: softmax's (reads output and gradient, writes n) and
the in-place fill's (reads n, writes n). Softmax saves its output, as the fused kernel does. Fused
(scaled_upper_triang_masked_softmax): 2 / 3."""

RESIDUAL_EAGER = {
    (True, True): Passes(fwd=7, bwd=3, fwd_kernels=3, bwd_kernels=2),
    (False, True): Passes(fwd=5, bwd=2, fwd_kernels=2, bwd_kernels=1),
    (True, False): Passes(fwd=5, bwd=1, fwd_kernels=2, bwd_kernels=1),
}
"""(bias, dropout) -> passes of fused_bias_dropout.py's unfused path (``_bias_dropout_add_func``): ``x + bias``
(2), ``F.dropout`` (2 plus its 1-byte mask, written as the fused kernel writes it), ``residual + out`` (3).
Backward: dropout's (reads the gradient and mask, writes n) and the bias gradient's reduction (reads n); the
residual's gradient passes through. Autograd saves only dropout's mask (aten native_dropout): no more than the
fused kernel. Without bias and dropout both run one add (F.dropout with p = 0 returns its input): no change."""

ROPE_EAGER = Passes(fwd=10, bwd=10, fwd_kernels=10, bwd_kernels=10)
"""megatron/core/models/common/embeddings/rope_utils.py `_apply_rotary_pos_emb_bshd` without apply_rope_fusion,
once for Q and once for K: ``t * cos`` (2), `rotate_half` (negate half: 1, ``torch.cat``: 2), ``* sin`` (2),
the sum (3): 10 per element over five kernels each. Backward mirrors it (the two products, the negation, the
halves reassembled, the two gradients summed): 10. The products save cos and sin, buffers of s x d: nothing per
layer. Fused (TE's fused_apply_rotary_pos_emb): 2 / 2."""

RMSNORM_EAGER = Passes(fwd=20, bwd=54, fwd_kernels=8, bwd_kernels=17, saved=4)
"""RMSNorm as the eager fp32 composite (`ModelSpec.norm_fusion` False), measured: torch's ``F.rms_norm`` on a
16-bit input with a 16-bit weight, as the CPU build runs it, under a dispatch mode counting every aten op's tensor
bytes read and written (tests/unit/test_eager_traffic.py). Forward: the fp32 copy (3), ``pow`` (4), ``mean``
(2), ``* rsqrt`` (4), ``* weight`` in fp32 (4), the cast back (3), plus the eps add and rsqrt over one value per
token: 20 over eight kernels. Backward: 54 over seventeen (the two products' gradients, the weight's reduction,
the mean and pow chain, the two fp32 input gradients summed, the casts). It keeps the fp32 input and the fp32
normalized input (8 bytes per element: 4 units) and fp32 1/rms per token, and not its 16-bit input. Megatron-LM's
legacy ``rms_norm.py`` and torchtitan's 2024 ``RMSNorm`` cast back before the weight product (in 16 bits): a unit
less each way; lynx prices them as this composite. Fused (one kernel each way, saves its 16-bit input): 2 / 4."""

FP32_BYTES = 4.0

MAIN_GRAD_PASS_BYTES = 10.0
"""Without gradient_accumulation_fusion (megatron/core/tensor_parallel/layers.py,
LinearWithGradAccumulationAndAsyncCommunication.backward: ``grad_output.t().matmul(total_input)`` instead of
``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``) the weight gradient is written in 16 bits and the
DDP hook adds it into the fp32 main gradient (distributed_data_parallel.py ``param.main_grad.add_(param.grad
.data)``): per weight element read 2 + 4, write 4, every micro-batch. The fused GEMM accumulates in its epilogue
(compute-bound: no extra time)."""


def check_norm_fusion(m: ModelSpec) -> None:
    """`norm_fusion` False describes an eager RMSNorm; torch's and TransformerEngine's LayerNorm run one kernel."""
    if not m.norm_fusion and m.normalization != "rmsnorm":
        raise SpecError(f"model {m.name!r}: norm_fusion false prices an eager RMSNorm; normalization "
                        f"{m.normalization!r} runs as one kernel (set norm_fusion true)")


def check_compiled(m: ModelSpec) -> None:
    """`compiled` is torchtitan's torch.compile of its blocks; Megatron-Core's kernels are fused already."""
    if m.compiled:
        raise SpecError(f"model {m.name!r}: compiled true prices torchtitan's torch.compile of its blocks; family "
                        f"{m.family} runs Megatron-Core's fused kernels (valid: compiled false, or family "
                        "torchtitan-llama3)")
    if m.fp8 is not None and m.fp8.engine is Fp8Engine.TORCHAO:
        raise SpecError(f"model {m.name!r}: {m.fp8.describe()} is torchtitan's float8 converter; family {m.family} "
                        "runs TransformerEngine's FP8 (valid: --fp8-format / --fp8-recipe, or family "
                        "torchtitan-llama3)")


def check_kv_repeat(m: ModelSpec) -> None:
    """`kv_repeat` describes torchtitan's 2024 attention; only the torchtitan family prices it (decision 0263)."""
    if m.kv_repeat:
        raise SpecError(f"model {m.name!r}: kv_repeat true prices torchtitan's 2024 attention (separate wq/wk/wv, "
                        f"K and V copied to every query head); family {m.family} does not run it (valid: kv_repeat "
                        "false, or family torchtitan-llama3)")


def eager_rmsnorm(b: LayerBuilder, name: str, tokens: float, hidden: float) -> None:
    """Re-describe the norm `name` (already added) as the eager fp32 composite: `RMSNORM_EAGER`'s traffic and
    kernels; it keeps its fp32 input and normalized input and fp32 1/rms per token (side state) and a tensor of
    its output's size (the weight product's operand: its own output, counted once with the GEMM that reads it),
    not its 16-bit input. What torchtitan's block keeps on CPU, measured (tests/unit/test_titan_profile_reads.py,
    tests/unit/test_export_torchtitan_bytes.py)."""
    b.eager(name, RMSNORM_EAGER, tokens * hidden)
    i = next(j for j, o in enumerate(b.ops) if o.name == name)
    b.ops[i] = dataclasses.replace(b.ops[i], saved=(name,), mask_bytes=b.ops[i].mask_bytes + FP32_BYTES * tokens)


def apply(b: LayerBuilder, m: ModelSpec) -> None:
    """Re-describe the ops of `b` that `m`'s disabled fusions run eager (nothing when every fusion is on)."""
    names = {o.name: o for o in b.ops}

    def elems(name: str) -> float:
        return names[name].out_bytes / ACT_BYTES

    if not m.norm_fusion and m.normalization == "rmsnorm":
        for r in ("rmsnorm1", "rmsnorm2"):
            if r in names:
                eager_rmsnorm(b, r, elems(r) / m.hidden_size, m.hidden_size)
    if not m.bias_activation_fusion:
        if "swiglu" in names:
            b.eager("swiglu", SWIGLU_EAGER, elems("swiglu"))
        if "gelu" in names and m.bias == "all":
            b.eager("gelu", GELU_BIAS_EAGER, elems("gelu"))
    if not m.masked_softmax_fusion and "softmax" in names:
        b.eager("softmax", SOFTMAX_EAGER, elems("softmax"))
    if not m.apply_rope_fusion and "rope" in names:
        b.eager("rope", ROPE_EAGER, elems("rope"))
    if not m.bias_dropout_fusion:
        for r in ("attn_residual", "mlp_residual"):
            if r in names:
                drop = names[r].mask_bytes > 0
                key = (m.bias == "all", drop)
                if key in RESIDUAL_EAGER:
                    b.eager(r, RESIDUAL_EAGER[key], elems(r))


__all__ = ["GELU_BIAS_EAGER", "MAIN_GRAD_PASS_BYTES", "RESIDUAL_EAGER", "RMSNORM_EAGER", "ROPE_EAGER",
           "SOFTMAX_EAGER", "SWIGLU_EAGER", "apply", "check_compiled", "check_kv_repeat", "check_norm_fusion",
           "eager_rmsnorm"]
