"""Fused attention for Megatron-Core's local layer spec: what a lynx plan with ``attention: flash`` prices.

A plan with ``attention: flash`` has one ``core_attn`` op: the attention kernel that keeps no s x s scores (it saves
its inputs, its output and the softmax statistics, and recomputes the scores in its backward). Megatron-Core's local
spec has only `DotProductAttention` (the unfused scores, softmax, dropout and context: a plan with ``attention:
standard``); its TransformerEngine spec has `TEDotProductAttention`, whose fused linears lynx's engine does not run.
`FlashDotProductAttention` is the third way in: a `CoreAttention` of Megatron-Core's own protocol
(``megatron.core.transformer.attention.CoreAttention``) running PyTorch's ``scaled_dot_product_attention``, which
on an H100 in bf16 / fp16 dispatches to a fused kernel that keeps no s x s scores (flash or memory-efficient
attention, as PyTorch picks). `with_flash_attention` puts it into a layer spec
(the local one, ``get_gpt_layer_local_spec``); Megatron-Core builds it as it builds any core attention, and lynx's
engine computes the plan's ``core_attn`` op with the same function (`flash_context`), so a model runs the same
kernel with lynx's engine on it and without.

What it supports: causal self-attention (the mask tensor Megatron passes is not read; the kernel masks causally, as
TransformerEngine's causal attention does), grouped-query attention, attention dropout (drawn under Megatron's RNG
tracker as `DotProductAttention` draws it), the softmax scale Megatron computes. Refused in one line: packed
sequences, attention bias, context parallelism, a non-causal mask type, ``apply_query_key_layer_scaling``, sliding
windows and softmax variants other than ``vanilla``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType  # type: ignore[import-untyped]
from megatron.core.transformer.module import MegatronModule  # type: ignore[import-untyped]


def _refuse(why: str) -> ValueError:
    return ValueError(f"lynx.integrations.megatron.FlashDotProductAttention: {why}")


def flash_context(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  dropout_p: float) -> torch.Tensor:
    """Causal attention on Megatron's layouts: query [sq, b, np, hn], key and value [sk, b, ng, hn] (ng divides
    np: query head h reads group h // (np / ng), as `DotProductAttention`'s repeat_interleave does); returns the
    context [sq, b, np * hn]. The kernel reads permuted views (no copies); its autograd node saves them, the output
    and the softmax statistics."""
    sq, b, heads, hn = query.shape
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                         enable_gqa=key.size(2) != heads)
    return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


class FlashDotProductAttention(MegatronModule):  # type: ignore[misc]
    """Megatron-Core core attention (the `CoreAttentionBuilder` signature) on ``scaled_dot_product_attention``."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise _refuse(f"context parallelism (context_parallel_size {config.context_parallel_size})")
        if attn_mask_type != AttnMaskType.causal:
            raise _refuse(f"attn_mask_type {attn_mask_type!r}; only causal self-attention is supported")
        if config.apply_query_key_layer_scaling:
            raise _refuse("apply_query_key_layer_scaling (switch it off)")
        if getattr(config, "window_size", None) is not None:
            raise _refuse(f"window_size {config.window_size} (sliding-window attention)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise _refuse(f"softmax_type {config.softmax_type!r}; only 'vanilla'")
        if pg_collection is None:
            from megatron.core import parallel_state  # type: ignore[import-untyped]

            tp = parallel_state.get_tensor_model_parallel_world_size()
        else:
            tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads_per_partition = config.num_attention_heads // tp
        self.groups_per_partition = (config.num_query_groups or config.num_attention_heads) // tp
        head_dim = config.kv_channels
        self.hidden_size_per_partition = head_dim * self.heads_per_partition
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None, attention_bias: Any = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None:
            raise _refuse("packed sequences (packed_seq_params)")
        if attention_bias is not None:
            raise _refuse("attention_bias")
        return attend(self, query, key, value)


def dropout_p(core: FlashDotProductAttention) -> float:
    """The dropout the kernel applies now (none in evaluation)."""
    return core.dropout_p if core.training else 0.0


def attend(core: FlashDotProductAttention, query: torch.Tensor, key: torch.Tensor,
           value: torch.Tensor) -> torch.Tensor:
    """The module's computation, which lynx's engine calls for the plan's ``core_attn`` op: dropout drawn under
    Megatron's RNG tracker as `DotProductAttention` draws it (the whole block already runs under it with SP)."""
    p = dropout_p(core)
    if p > 0 and not core.config.sequence_parallel:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker  # type: ignore[import-untyped]

        with get_cuda_rng_tracker().fork():
            return flash_context(query, key, value, core.softmax_scale, p)
    return flash_context(query, key, value, core.softmax_scale, p)


def with_flash_attention(spec: Any) -> Any:
    """A Megatron-Core layer spec (a `TransformerLayer` spec such as ``get_gpt_layer_local_spec()``, or a
    `TransformerBlock` spec of such layers) with `FlashDotProductAttention` as every layer's core attention."""
    sub: Any = getattr(spec, "submodules", None)
    if sub is not None and hasattr(sub, "layer_specs"):
        layers = [with_flash_attention(s) for s in sub.layer_specs]
        return dataclasses.replace(spec, submodules=dataclasses.replace(sub, layer_specs=layers))
    att: Any = getattr(sub, "self_attention", None)
    if att is None or not hasattr(getattr(att, "submodules", None), "core_attention"):
        raise TypeError("lynx.integrations.megatron.with_flash_attention: the spec has no "
                        "submodules.self_attention.submodules.core_attention (pass a GPT layer spec such as "
                        "get_gpt_layer_local_spec())")
    att = dataclasses.replace(att, submodules=dataclasses.replace(att.submodules,
                                                                  core_attention=FlashDotProductAttention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, self_attention=att))


__all__ = ["FlashDotProductAttention", "attend", "flash_context", "with_flash_attention"]
