"""Megatron-Core 0.16.1's MLP between linear_fc1 and linear_fc2 (megatron/core/transformer/mlp.py,
``MLP.forward`` without a per-token scale): the same branches in the same order, calling the same functions,
so the activation op computes bit for bit what the MLP computes. TransformerEngine's activation
(``use_te_activation_func``) is refused by `check`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def check(config: Any) -> str | None:
    """Why this MLP's activation is not modelled here, or None."""
    if getattr(config, "use_te_activation_func", False):
        return "use_te_activation_func (TransformerEngine's activation) is not supported"
    if config.bias_activation_fusion:
        gated, act = config.gated_linear_unit, config.activation_func
        if not ((act is F.gelu) or (act is F.silu and gated)):
            return "bias_activation_fusion with an activation other than gelu / swiglu"
    return None


def apply(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    cfg = mlp.config
    bias = mlp.linear_fc1.bias
    if cfg.bias_activation_fusion:
        from megatron.core.transformer import mlp as mmlp  # type: ignore[import-untyped]  # the functions MLP.forward calls

        if mlp.activation_func is F.gelu:
            fused = mmlp.bias_geglu_impl if cfg.gated_linear_unit else mmlp.bias_gelu_impl
            out: torch.Tensor = fused(x, bias)
            return out
        out = mmlp.bias_swiglu_impl(x, bias, cfg.activation_func_fp8_input_store,
                                    cfg.cpu_offloading and cfg.cpu_offloading_activations and mmlp.HAVE_TE)
        return out
    if bias is not None:
        x = x + bias
    if cfg.gated_linear_unit:
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if (val := cfg.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        gated: torch.Tensor = cfg.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)
        return gated
    act: torch.Tensor = mlp.activation_func(x)
    return act
