"""FP8's static memory and parameter gather: the FP8 weight copies TransformerEngine keeps, and what
--fp8-param-gather changes in the parameter buffer and its all-gather.

* Without FP8 parameters (Megatron's default) every TE linear layer quantizes its 16-bit weight once per
  iteration (Megatron-Core passes ``is_first_microbatch``: megatron/core/extensions/transformer_engine.py,
  TELinear.forward) and caches the FP8 copy for the other micro-batches (``self._fp8_workspaces["weight"]``,
  TransformerEngine module/linear.py): the row-wise copy for the forward GEMM and, on Hopper, the column-wise
  (transposed) one for the input gradient. Two bytes per weight element stay allocated besides the 16-bit weight.
* With --fp8-param-gather (TransformerConfig.fp8_param: TE's ``fp8_model_init``) the weights are FP8 tensors: one
  byte plus the transposed copy TE keeps for the backward, no 16-bit copy and no workspace; the distributed
  optimizer all-gathers those weights' bytes in FP8 (one byte each) after its step.

Only the GEMM weights of the transformer layers are FP8 (norms, biases, embedding and output layer stay 16-bit).
The scales (one fp32 per tensor, per 128 x 128 block for blockwise weights) and the amax histories (fp32, at most a
few thousand entries per tensor) are a few kilobytes per layer: left out.
"""

from __future__ import annotations

import functools

from lynx.cost.fp8 import FP8_BYTES, linear_weight_elements
from lynx.families import get_family
from lynx.fp8 import Fp8Engine
from lynx.spec import ModelSpec, ParallelSpec

FP8_WEIGHT_COPIES = 2.0
"""Row-wise and column-wise (transposed) FP8 copies of a weight on Hopper."""


@functools.lru_cache(maxsize=512)
def fp8_weight_elements(model: ModelSpec, par: ParallelSpec) -> float:
    """FP8 weight elements of one layer on one TP rank (0 without FP8)."""
    if model.fp8 is None:
        return 0.0
    return linear_weight_elements(get_family(model.family).layer(model, par))


def fp8_static_delta(model: ModelSpec, par: ParallelSpec, num_layers: int, param_bytes: float) -> float:
    """Bytes FP8 adds to (or, with FP8 parameters, removes from) a stage's parameter memory whose recipe counts
    `param_bytes` per parameter: the FP8 weight workspace, or the FP8 parameters in place of the 16-bit ones."""
    if model.fp8 is None or model.fp8.engine is Fp8Engine.TORCHAO:  # torchao caches no FP8 weight
        return 0.0
    n = num_layers * fp8_weight_elements(model, par)
    if model.fp8.param_gather:
        return n * (FP8_WEIGHT_COPIES * FP8_BYTES - param_bytes)
    return n * FP8_WEIGHT_COPIES * FP8_BYTES


def gathered_param_bytes(model: ModelSpec, par: ParallelSpec, params: float, layer_params: float,
                         param_bytes: float) -> float:
    """Bytes the distributed optimizer all-gathers for `params` parameters of which `layer_params` belong to
    transformer layers: with --fp8-param-gather (torchao: FSDP's float8 all-gather) the layers' GEMM weights move
    one byte each, the rest their own."""
    if model.fp8 is None or not model.fp8.param_gather or layer_params <= 0:
        return params * param_bytes
    per_layer = get_family(model.family).layer_params(model, par.tp)
    fp8 = layer_params * fp8_weight_elements(model, par) / per_layer
    return (params - fp8) * param_bytes + fp8 * FP8_BYTES


__all__ = ["FP8_WEIGHT_COPIES", "fp8_static_delta", "fp8_weight_elements", "gathered_param_bytes"]
