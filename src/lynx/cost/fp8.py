"""FP8 linear layers as TransformerEngine runs them under Megatron-Core: the layer's op specs rewritten.

Every weight GEMM of a layer (QKV, projection, FC1 / gate-up, FC2 / down) becomes an FP8 GEMM fed by a quantize
op ``<gemm>_fp8`` that TransformerEngine runs in front of it (``transformer_engine/pytorch/module/linear.py``,
``_Linear.forward`` at TransformerEngine d0067d0, 2026-08; the same logic in layernorm_linear.py):

* what backward keeps: the FP8 copy of the GEMM's input, 1 byte per element plus the recipe's scales, instead of
  the 16-bit input. Without an all-gather TE quantizes row-wise and column-wise and, once the forward GEMM ran,
  discards the row-wise half (``inputmat.update_usage(rowwise_usage=False, columnwise_usage=True)``): one byte
  is kept. With sequence parallelism TE quantizes the local shard, all-gathers it in FP8 and keeps the local FP8
  shard (per-tensor recipes: row-wise only, "All-gather is not supported with FP8 column-wise data"); backward
  re-gathers it in FP8 and transposes the gathered tensor for the weight gradient;
* what moves: the quantize pass (read 16 bits, write the row-wise and, on Hopper, the column-wise transposed
  copy: FP8 GEMMs there run only in the TN layout), an amax pass first for current scaling (tensorwise), and in
  backward the quantize of the output gradient (E5M2 with hybrid) row-wise and column-wise for the input- and
  weight-gradient GEMMs; the sequence-parallel all-gather and its backward re-gather move FP8 bytes;
* the GEMM itself at the device's FP8 rate (`OpSpec.fp8`: `DeviceSpec.fp8_peak_flops` x its FP8 efficiency by
  shape), its operands read as 1 byte.

What stays 16-bit: core attention (Megatron's fp8_dot_product_attention is off by default), norms, activations,
residuals, the embedding and the output layer (Megatron-Core's own ColumnParallelLinear, not TE's); the
gradients' reduce-scatter / all-reduce in the sequence- and tensor-parallel collectives.

A recomputed or offloaded ``<gemm>_fp8`` moves its FP8 bytes: it is an op of the graph like any other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lynx.families.base import ACT_BYTES, LayerSpec, OpSpec
from lynx.fp8 import Fp8, Fp8Recipe
from lynx.graph import LAYER_INPUT

FP8_BYTES = 1.0
"""One byte per FP8 element (E4M3 and E5M2 alike)."""


@dataclass(frozen=True, slots=True)
class CastRule:
    """How one recipe's quantize runs on Hopper (bytes per element of the tensor quantized). Hopper's FP8 GEMMs
    take only the TN layout, so every column-wise use (weight gradient, input gradient through W^T) reads a
    transposed copy (TransformerEngine utils.py ``non_tn_fp8_gemm_supported``: False before Blackwell)."""

    recipe: Fp8Recipe

    @property
    def copy_bytes(self) -> float:
        """One FP8 copy of an element with its scales."""
        return FP8_BYTES + self.recipe.scale_bytes_per_element

    def quantize_bytes(self, columnwise: bool) -> float:
        """HBM bytes of quantizing one 16-bit element: the read, an amax pass for current scaling, and the
        row-wise copy with, where wanted and needed, the column-wise one."""
        amax = ACT_BYTES if self.recipe is Fp8Recipe.TENSORWISE else 0.0
        return ACT_BYTES + amax + self.copy_bytes * (2 if columnwise else 1)

    @property
    def kernels(self) -> int:
        """Delayed scaling fuses cast, transpose and amax (fp8_cast_transpose_fused); current scaling needs the
        amax before the cast: two kernels."""
        return 2 if self.recipe is Fp8Recipe.TENSORWISE else 1


def _elems(spec_ops: dict[str, OpSpec], name: str, input_bytes: float) -> float:
    if name == LAYER_INPUT:
        return input_bytes / ACT_BYTES
    return spec_ops[name].out_bytes / ACT_BYTES


def _rewrite_gemm(g: OpSpec, by_name: dict[str, OpSpec], rule: CastRule, input_bytes: float,
                  ) -> tuple[OpSpec, OpSpec, OpSpec | None]:
    """(quantize op, FP8 GEMM, the SP all-gather rewired to FP8 or None) for one weight GEMM."""
    assert g.gemm_mnk is not None
    m, k, n = g.gemm_mnk
    first = by_name.get(g.inputs[0])
    gather = first if first is not None and first.kind == "comm" and first.regather else None
    src = gather.inputs[0] if gather is not None else g.inputs[0]
    local = _elems(by_name, src, input_bytes) if gather is not None else m * k
    # per-tensor recipes gather row-wise only and transpose the gathered tensor in backward
    columnwise_now = gather is None or rule.recipe.gathers_columnwise
    bwd_transpose = FP8_BYTES * 2 * m * k if gather is not None and not columnwise_now else 0.0
    name = f"{g.name}_fp8"
    cast = OpSpec(
        name=name, kind="compute", block=g.block, inputs=(src,), saved=(), out_bytes=rule.copy_bytes * local,
        flops=local, mem_bytes=rule.quantize_bytes(columnwise_now) * local, bwd_factor=1.0, module=g.module,
        kernels=rule.kernels,
        # backward: the output gradient quantized for dgrad (row-wise) and wgrad (column-wise), and the
        # gathered input's transpose for wgrad
        bwd_mem_bytes=rule.quantize_bytes(True) * m * n + bwd_transpose,
        bwd_kernels=rule.kernels + (1 if bwd_transpose else 0),
    )
    fp8_gemm = dataclasses.replace(
        g, inputs=g.inputs if gather is not None else (name,), saved=(name,), fp8=True,
        mem_bytes=rule.copy_bytes * (m * k + k * n) + ACT_BYTES * m * n)
    new_gather = dataclasses.replace(gather, inputs=(name,), gather_bytes=rule.copy_bytes * m * k,
                                     out_bytes=rule.copy_bytes * m * k) \
        if gather is not None else None
    return cast, fp8_gemm, new_gather


def apply_fp8(spec: LayerSpec, f: Fp8) -> LayerSpec:
    """The layer with its weight GEMMs in FP8 (module docstring)."""
    rule = CastRule(f.recipe)
    by_name = {o.name: o for o in spec.ops}
    out = list(spec.ops)
    for g in spec.ops:
        if g.kind != "compute" or g.gemm_mnk is None or g.wgrad_factor <= 0:
            continue  # attention's batched GEMMs have no weights: they stay 16-bit
        cast, gemm, gather = _rewrite_gemm(g, by_name, rule, spec.input_bytes)
        out[out.index(g)] = gemm
        at = out.index(by_name[gather.name]) if gather is not None else out.index(gemm)
        if gather is not None:
            out[at] = gather
        out.insert(at, cast)
    return LayerSpec(tuple(out), spec.input_bytes)


def linear_weight_elements(spec: LayerSpec) -> float:
    """Weight elements of the layer's GEMMs on one TP rank (what TransformerEngine keeps FP8 copies of)."""
    return sum(o.gemm_mnk[1] * o.gemm_mnk[2] for o in spec.ops
               if o.kind == "compute" and o.gemm_mnk is not None and o.wgrad_factor > 0)


__all__ = ["FP8_BYTES", "CastRule", "apply_fp8", "linear_weight_elements"]
