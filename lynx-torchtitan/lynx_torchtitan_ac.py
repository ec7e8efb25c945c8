"""Per-block activation checkpointing for torchtitan, from a lynx plan (written by `lynx export torchtitan`).

Each transformer block ``layers.<i>`` gets what the plan chose for global layer i:

- ``none``: not wrapped (every activation kept);
- ``full``: the whole block recomputed before its backward (torchtitan's FullAC for that block);
- ``selective``: torch.utils.checkpoint's selective-checkpoint contexts with a policy that returns
  ``MUST_SAVE`` for the aten ops whose outputs the plan keeps and ``MUST_RECOMPUTE`` for those it recomputes.

lynx names ops (qkv, attn_proj, fc1, gelu, ...); torch sees aten ops. An aten op is named by its *category*
(matmul, batched matmul, softmax, dropout, norm, activation, attention kernel) and its position among the
ops of that category in one block's forward: the k-th matmul of a GPT block is qkv, attn_proj, fc1, fc2 for
k = 0..3. ``ORDER`` holds that table per family; docs/export.md lists the limits (elementwise ops such as
residual adds and rotary embeddings are always recomputed; RMSNorm that decomposes into elementwise ops is
recomputed even when kept). Recomputation runs on demand: lynx's overlap with collectives is not expressible.

Use: in torchtitan 0.3.0, set ``activation_checkpoint=LynxPlanAC.Config()`` in your config_registry
function (torchtitan calls ``.build().apply(model_part)`` per pipeline part); without torchtitan,
``apply_lynx_ac(model)`` wraps any model whose blocks live in ``model.layers``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# written by `lynx export torchtitan`
LYNX_AC: dict[str, Any] = {'family': 'llama',
 'method': 'lynx',
 'layers': [{'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []},
            {'mode': 'none',
             'keep': ['rmsnorm1', 'qkv', 'rope', 'core_attn', 'attn_residual', 'rmsnorm2', 'gate_up',
                      'swiglu'],
             'recompute': []}]}
# written by `lynx export torchtitan`
LYNX_CONFIG: dict[str, Any] = {'parallelism': {'pipeline_parallel_degree': 4,
                 'tensor_parallel_degree': 4,
                 'enable_sequence_parallel': True,
                 'data_parallel_replicate_degree': 2,
                 'data_parallel_shard_degree': 1,
                 'context_parallel_degree': 2,
                 'pipeline_parallel_schedule': 'Interleaved1F1B',
                 'pipeline_parallel_microbatch_size': 1,
                 'module_fqns_per_model_part': [['tok_embeddings', 'layers.0', 'layers.1', 'layers.2'],
                                                ['layers.3', 'layers.4', 'layers.5', 'layers.6', 'layers.7'],
                                                ['layers.8', 'layers.9', 'layers.10', 'layers.11',
                                                 'layers.12'],
                                                ['layers.13', 'layers.14', 'layers.15', 'layers.16'],
                                                ['layers.17', 'layers.18', 'layers.19', 'layers.20'],
                                                ['layers.21', 'layers.22', 'layers.23', 'layers.24'],
                                                ['layers.25', 'layers.26', 'layers.27', 'layers.28'],
                                                ['layers.29', 'layers.30', 'layers.31', 'layers.32'],
                                                ['layers.33', 'layers.34', 'layers.35', 'layers.36'],
                                                ['layers.37', 'layers.38', 'layers.39', 'layers.40'],
                                                ['layers.41', 'layers.42', 'layers.43', 'layers.44'],
                                                ['layers.45', 'layers.46', 'layers.47', 'layers.48'],
                                                ['layers.49', 'layers.50', 'layers.51', 'layers.52'],
                                                ['layers.53', 'layers.54', 'layers.55', 'layers.56'],
                                                ['layers.57', 'layers.58', 'layers.59', 'layers.60'],
                                                ['layers.61', 'layers.62', 'layers.63', 'layers.64'],
                                                ['layers.65', 'layers.66', 'layers.67', 'layers.68'],
                                                ['layers.69', 'layers.70', 'layers.71', 'layers.72'],
                                                ['layers.73', 'layers.74', 'layers.75', 'layers.76'],
                                                ['layers.77', 'layers.78', 'layers.79', 'norm', 'lm_head']]},
 'training': {'local_batch_size': 64, 'global_batch_size': 128, 'seq_len': 8192}}

_aten = torch.ops.aten


def _categories() -> dict[Any, str]:
    cats: dict[Any, str] = {
        _aten.mm.default: "mm", _aten.addmm.default: "mm", _aten.linear.default: "mm",
        _aten.bmm.default: "bmm", _aten.baddbmm.default: "bmm",
        _aten._softmax.default: "softmax", _aten.native_dropout.default: "dropout",
        _aten.native_layer_norm.default: "norm", _aten.gelu.default: "gelu", _aten.silu.default: "silu",
    }
    for name in ("_fused_rms_norm",):
        if hasattr(_aten, name):
            cats[getattr(_aten, name).default] = "norm"
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable"):
        if hasattr(_aten, name):
            cats[getattr(_aten, name).default] = "sdpa"
    flex = getattr(torch._higher_order_ops, "flex_attention", None)  # torchtitan's default attention
    if flex is not None:
        cats[flex] = "sdpa"
    return cats


CATEGORY = _categories()

# written by `lynx export torchtitan`
ORDER: dict[str, dict[str, list[str]]] = {'gpt': {'norm': ['ln1', 'ln2'],
         'mm': ['qkv', 'attn_proj', 'fc1', 'fc2'],
         'bmm': ['attn_scores', 'attn_context'],
         'softmax': ['softmax'],
         'sdpa': ['core_attn'],
         'dropout': ['attn_dropout', 'attn_residual', 'mlp_residual'],
         'gelu': ['gelu']},
 'llama': {'norm': ['rmsnorm1', 'rmsnorm2'],
           'mm': ['qkv', 'attn_proj', 'gate_up', 'gate_up', 'down'],
           'sdpa': ['core_attn'],
           'silu': ['swiglu']}}


def apply_lynx_config(config: Any, schedule_csv: str | None = None) -> Any:
    """Set the plan's parallelism and batch fields, the schedule CSV (default: the file written beside this
    module) and this activation checkpointing on a torchtitan Trainer.Config; returns it."""
    import os

    for section, fields in LYNX_CONFIG.items():
        for key, value in fields.items():
            setattr(getattr(config, section), key, value)
    csv = schedule_csv or os.path.join(os.path.dirname(os.path.abspath(__file__)), "lynx_schedule.csv")
    config.parallelism.pipeline_parallel_schedule_csv = csv
    config.activation_checkpoint = LynxPlanAC.Config()
    return config


def op_name(family: str, category: str, k: int) -> str | None:
    names = ORDER[family].get(category, [])
    return names[k] if k < len(names) else None


def make_policy(layer: dict[str, Any], family: str) -> Callable[..., CheckpointPolicy]:
    """A selective-checkpoint policy for one block; counts categories separately in forward and recompute."""
    keep, recompute = set(layer["keep"]), set(layer["recompute"])
    counts: dict[tuple[bool, str], int] = {}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        cat = CATEGORY.get(func)
        if cat is None:
            return CheckpointPolicy.PREFER_RECOMPUTE
        key = (bool(ctx.is_recompute), cat)
        k = counts.get(key, 0)
        counts[key] = k + 1
        name = op_name(family, cat, k)
        if name in keep:
            return CheckpointPolicy.MUST_SAVE
        if name in recompute:
            return CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def layer_plan(layer_id: int, table: dict[str, Any] | None = None) -> dict[str, Any]:
    t = LYNX_AC if table is None else table
    if not t:
        raise ValueError("lynx AC: no plan table; write this file with `lynx export torchtitan`")
    layers = t["layers"]
    if not 0 <= layer_id < len(layers):
        raise ValueError(f"lynx AC: layer {layer_id} outside the plan's {len(layers)} layers")
    return dict(layers[layer_id])


def wrap_block(module: nn.Module, layer_id: int, table: dict[str, Any] | None = None,
               preserve_rng_state: bool = True, early_stop: bool = True) -> nn.Module:
    """The block wrapped as the plan says for global layer `layer_id` (unchanged for `none`)."""
    t = LYNX_AC if table is None else table
    lp = layer_plan(layer_id, t)
    if lp["mode"] == "none":
        return module
    if lp["mode"] == "full":
        return checkpoint_wrapper(module, preserve_rng_state=preserve_rng_state, early_stop=early_stop)
    family = str(t["family"])
    linears = sum(1 for m in module.modules() if isinstance(m, nn.Linear))
    if linears != len(ORDER[family]["mm"]):
        raise ValueError(f"lynx AC: layers.{layer_id} has {linears} linear layers; the plan's {family} op mapping "
                         f"expects {len(ORDER[family]['mm'])} (export a plan of this model's family)")
    return checkpoint_wrapper(
        module,
        context_fn=lambda: create_selective_checkpoint_contexts(make_policy(lp, family)),
        preserve_rng_state=preserve_rng_state,
        early_stop=early_stop,
    )


def apply_lynx_ac(model: nn.Module, table: dict[str, Any] | None = None, **kwargs: Any) -> nn.Module:
    """Wrap every block under ``model.layers`` (named by global layer id, as torchtitan keeps them after
    the pipeline split)."""
    layers = model.get_submodule("layers")
    for name, block in list(layers.named_children()):
        layers.register_module(name, wrap_block(block, int(name), table, **kwargs))
    return model


try:  # torchtitan's own AC base class, when torchtitan is installed
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing
except ImportError:  # pragma: no cover - plain torch use goes through apply_lynx_ac
    ActivationCheckpointing = None

if ActivationCheckpointing is not None:

    class LynxPlanAC(ActivationCheckpointing):  # type: ignore[misc,valid-type]
        """torchtitan ActivationCheckpointing that applies the lynx plan block by block."""

        @dataclass(kw_only=True, slots=True)
        class Config(ActivationCheckpointing.Config):  # type: ignore[name-defined,misc]
            early_stop: bool = True
            """Stop recomputing a block once every tensor its backward needs is back."""

        def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
            layer_id = int(str(base_fqn).rsplit(".", 1)[-1])
            return wrap_block(module, layer_id, preserve_rng_state=self.config.preserve_rng_state,
                              early_stop=self.config.early_stop)
