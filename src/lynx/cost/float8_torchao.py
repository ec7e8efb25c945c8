"""FP8 linear layers as torchao's ``Float8Linear`` runs them under torchtitan: the layer's op specs rewritten.

torchtitan's float8 converter swaps every ``nn.Linear`` of the blocks for torchao's ``Float8Linear`` (the output
layer is filtered out, as torchtitan's configs and its 2024 code do). Read at pytorch/ao 36027d82 (2026-08),
torchao/float8/float8_linear.py, ``matmul_with_hp_or_float8_args``, and config.py ``from_recipe_name``:

* what backward keeps: ``ctx.save_for_backward(input_hp, weight_hp_t)``, the 16-bit input and weight, as a 16-bit
  linear layer keeps them; every FP8 copy is made again in backward from them. So nothing changes in the saved
  bytes, except where the input arrives in FP8 already: tensorwise with torchtitan's float8 tensor parallelism
  all-gathers the sequence-parallel input in FP8 and the GEMM keeps that gathered FP8 tensor (1 byte per element);
  and ``enable_fsdp_float8_all_gather`` gathers the weight in FP8 (`lynx.cost.fp8_memory.gathered_param_bytes`);
* what moves, per weight GEMM ``[m, k] @ [k, n]``, each quantization priced as the kernels torch.compile makes of it
  (torchtitan's docs: compile is "required for competitive performance"; it fuses the amax and the cast):

  ==============================  =================  ==================  ===================
  quantization (bytes/element)    tensorwise         rowwise             rowwise_with_gw_hp
  ==============================  =================  ==================  ===================
  input, forward (m k)            5: amax, cast      3: one row pass     3
  weight, forward (k n)           5                  3                   3
  output gradient for dgrad (m n) 5                  3                   3
  weight for dgrad (k n)          3: scale kept      5: column pass      5 (tensorwise)
  output gradient for wgrad (m n) 3: amax shared     5: column pass      -- (16-bit wgrad)
  input for wgrad (m k)           3: scale kept      5: column pass      --
  ==============================  =================  ==================  ===================

  A row-wise scale along the reduction dimension is one persistent reduction fused with the cast (read 2, write
  1); a column-wise one needs a reduction pass over the column first (read 2 + read 2, write 1); tensorwise is a
  global amax pass and a cast, and in backward the forward's scalar scales are kept by compile's partitioner and
  the output gradient's amax is computed once for its two casts. The quantizations of one input shared by several
  GEMMs (wq / wk / wv, w1 / w3) are one (compile eliminates the repeats). Rowwise scales (4 bytes per row) and the
  weights' FP8 gather cast on the shard are left out (below 0.1% of the traffic at these shapes);
* the GEMMs run at the device's FP8 rate (`OpSpec.fp8`), their operands read as one byte; rowwise_with_gw_hp
  runs the weight-gradient GEMM in 16 bits (`OpSpec.fp8_wgrad`). The rate of torch's row-wise scaled GEMM kernel
  is taken as the tensor-wise one's (the device's one FP8 curve): not measured (benchmarks/gpu_session.sh).

What stays 16-bit: attention, norms, activations, the output layer, and every collective except the tensorwise
FP8 gathers named above.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lynx.cost.fp8 import FP8_BYTES
from lynx.families.base import ACT_BYTES, LayerSpec, OpSpec
from lynx.fp8 import Fp8, Fp8Recipe
from lynx.graph import LAYER_INPUT


@dataclass(frozen=True, slots=True)
class Quantize:
    """Bytes per element and kernels of one quantization."""

    nbytes: float
    kernels: int


ROW = Quantize(ACT_BYTES + FP8_BYTES, 1)
"""Row-wise along the reduction dimension: one pass (read the 16-bit row, write FP8)."""
COLUMN = Quantize(2 * ACT_BYTES + FP8_BYTES, 2)
"""Column-wise: the amax over each column first, then the cast."""
GLOBAL = Quantize(2 * ACT_BYTES + FP8_BYTES, 2)
"""Tensorwise with a fresh amax: the amax pass, then the cast."""
SCALED = Quantize(ACT_BYTES + FP8_BYTES, 1)
"""Tensorwise with the scale already known: the cast (and transpose) alone."""
FP8_TRANSPOSE = Quantize(2 * FP8_BYTES, 1)
"""An FP8 tensor made column-major for the weight gradient."""
NONE = Quantize(0.0, 0)


@dataclass(frozen=True, slots=True)
class Rule:
    """One recipe's quantizations (module docstring's table)."""

    input_fwd: Quantize
    weight_fwd: Quantize
    grad_dgrad: Quantize
    weight_dgrad: Quantize
    grad_wgrad: Quantize
    input_wgrad: Quantize
    fp8_wgrad: bool


RULES = {
    Fp8Recipe.TENSORWISE: Rule(GLOBAL, GLOBAL, GLOBAL, SCALED, SCALED, SCALED, True),
    Fp8Recipe.ROWWISE: Rule(ROW, ROW, ROW, COLUMN, COLUMN, COLUMN, True),
    Fp8Recipe.ROWWISE_GW_HP: Rule(ROW, ROW, ROW, GLOBAL, NONE, NONE, False),
}


def _weight_gemms(spec: LayerSpec) -> list[OpSpec]:
    return [o for o in spec.ops if o.kind == "compute" and o.gemm_mnk is not None and o.wgrad_factor > 0]


def apply_torchao(spec: LayerSpec, f: Fp8) -> LayerSpec:
    """The layer with its weight GEMMs as torchao's Float8Linear (module docstring)."""
    rule = RULES[f.recipe]
    by_name = {o.name: o for o in spec.ops}
    groups: dict[str, list[OpSpec]] = {}
    for g in _weight_gemms(spec):
        groups.setdefault(g.inputs[0], []).append(g)
    out = list(spec.ops)
    for src, gemms in groups.items():
        m, k, _ = gemms[0].gemm_mnk  # type: ignore[misc]
        first = by_name.get(src)
        gather = first if (f.recipe is Fp8Recipe.TENSORWISE and first is not None and first.kind == "comm"
                           and first.collective == "gather") else None
        # tensorwise float8 TP: the shard is quantized, gathered in FP8 and the gathered FP8 tensor kept
        in_elems = m * k
        q_elems = in_elems if gather is None else _shard_elems(gather, spec, by_name)
        fwd_bytes = rule.input_fwd.nbytes * q_elems
        fwd_kernels = rule.input_fwd.kernels
        in_wgrad = rule.input_wgrad if gather is None else FP8_TRANSPOSE
        bwd_bytes = in_wgrad.nbytes * in_elems
        bwd_kernels = in_wgrad.kernels
        for g in gemms:
            _, _, n = g.gemm_mnk  # type: ignore[misc]
            w_fwd = NONE if f.param_gather else rule.weight_fwd  # FSDP's FP8 gather brings it quantized
            w_dgrad = FP8_TRANSPOSE if f.param_gather else rule.weight_dgrad
            fwd_bytes += w_fwd.nbytes * k * n
            fwd_kernels += w_fwd.kernels
            bwd_bytes += (rule.grad_dgrad.nbytes + rule.grad_wgrad.nbytes) * m * n + w_dgrad.nbytes * k * n
            bwd_kernels += rule.grad_dgrad.kernels + rule.grad_wgrad.kernels + w_dgrad.kernels
        name = f"{gemms[0].name}_fp8"
        cast_src = gather.inputs[0] if gather is not None else src
        cast = OpSpec(name=name, kind="compute", block=gemms[0].block, inputs=(cast_src,), saved=(),
                      out_bytes=FP8_BYTES * q_elems, flops=q_elems, mem_bytes=fwd_bytes, bwd_factor=1.0,
                      module=gemms[0].module, kernels=fwd_kernels, bwd_mem_bytes=bwd_bytes, bwd_kernels=bwd_kernels)
        for g in gemms:
            _, _, n = g.gemm_mnk  # type: ignore[misc]
            new = dataclasses.replace(
                g, inputs=g.inputs if gather is not None else (name,), fp8=True, fp8_wgrad=rule.fp8_wgrad,
                mem_bytes=FP8_BYTES * (m * k + k * n) + ACT_BYTES * m * n)
            out[out.index(g)] = new
        if gather is not None:
            at = out.index(gather)
            out[at] = dataclasses.replace(gather, inputs=(name,), gather_bytes=FP8_BYTES * in_elems,
                                          out_bytes=FP8_BYTES * in_elems)
        else:
            at = min(i for i, x in enumerate(out) if x.name in {g.name for g in gemms})
        out.insert(at, cast)
    return LayerSpec(tuple(out), spec.input_bytes)


def _shard_elems(gather: OpSpec, spec: LayerSpec, by_name: dict[str, OpSpec]) -> float:
    """Elements of the sequence-parallel shard a gather reads (its input op's output, or the layer input)."""
    src = gather.inputs[0]
    nbytes = spec.input_bytes if src == LAYER_INPUT else by_name[src].out_bytes
    return nbytes / ACT_BYTES


__all__ = ["RULES", "Quantize", "Rule", "apply_torchao"]
