"""The one module of lynx.integrations.megatron that reads Megatron-Core's internals: the layout of its
`TransformerLayer` built from the local layer spec (`get_gpt_layer_local_spec`: attribute names are not an
API), the private RNG-state functions of ``tensor_parallel.random`` that its own `CheckpointFunction` uses,
and the version pins. Everything else in the package goes through here.

Tested with megatron-core 0.16.1 and torch 2.13; other versions are refused with one line naming both (set
``LYNX_MEGATRON_UNPINNED=1`` to try anyway: tests/integration/test_megatron_*.py say whether the layer still
computes what Megatron computes).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

TESTED = {"megatron-core": "0.16.1", "torch": "2.13"}


class MegatronVersionError(RuntimeError):
    pass


def check_versions() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        mc = version("megatron-core")
    except PackageNotFoundError:
        raise MegatronVersionError("lynx.integrations.megatron: megatron-core is not installed") from None
    have = {"megatron-core": mc, "torch": torch.__version__}
    bad = [f"{k} {have[k]} (tested: {v})" for k, v in TESTED.items() if not have[k].startswith(v)]
    if bad and os.environ.get("LYNX_MEGATRON_UNPINNED") != "1":
        raise MegatronVersionError(
            "lynx.integrations.megatron: untested " + ", ".join(bad) + "; it reads Megatron-Core's layer layout "
            "(lynx/integrations/megatron/_fence.py). Set LYNX_MEGATRON_UNPINNED=1 to try anyway")


@dataclass(frozen=True)
class LayerParts:
    """What lynx needs of one Megatron-Core `TransformerLayer` (local spec), on this TP rank."""

    layer: Any
    config: Any
    input_layernorm: Any
    pre_mlp_layernorm: Any
    attention: Any
    """Its `SelfAttention` (the projections, the head counts, the RoPE settings)."""
    core: Any
    """Its core attention: `DotProductAttention` (Megatron's local, unfused attention: softmax module, dropout,
    scale) or lynx's `FlashDotProductAttention` (`lynx.integrations.megatron.attention`)."""
    mlp: Any
    heads: int
    """Query heads on this rank."""
    groups: int
    """Key/value groups on this rank."""
    head_dim: int
    global_index: int
    """0-based layer number in the whole model (Megatron's ``layer_number`` - 1)."""


def _identity(m: Any) -> bool:
    return m is None or type(m).__name__ in ("IdentityOp", "IdentityFuncOp")


def _refuse(why: str) -> TypeError:
    return TypeError(f"lynx.integrations.megatron: {why}")


def layer_parts(layer: Any) -> LayerParts:
    """Read a Megatron-Core TransformerLayer; one clear line when it is not the local spec's dense layer."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # type: ignore[import-untyped]
    from megatron.core.transformer.attention import SelfAttention  # type: ignore[import-untyped]
    from megatron.core.transformer.dot_product_attention import DotProductAttention  # type: ignore[import-untyped]
    from megatron.core.transformer.mlp import MLP  # type: ignore[import-untyped]

    from lynx.integrations.megatron.attention import FlashDotProductAttention

    name = type(layer).__name__
    att, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
    if not isinstance(att, SelfAttention):
        raise _refuse(f"{name}'s self_attention is {type(att).__name__}, not Megatron-Core's SelfAttention")
    if not isinstance(mlp, MLP):
        raise _refuse(f"{name}'s mlp is {type(mlp).__name__} (MoE or other); only the dense MLP is modelled")
    core = att.core_attention
    if not isinstance(core, (DotProductAttention, FlashDotProductAttention)):
        raise _refuse(f"core attention {type(core).__name__} (TransformerEngine spec): only the local spec's "
                      "DotProductAttention (a plan with attention: standard) or lynx's FlashDotProductAttention "
                      "(attention: flash; with_flash_attention(get_gpt_layer_local_spec())) is supported here "
                      "(TransformerEngine is not installed where this integration was built and tested)")
    for where, lin, cls in (("linear_qkv", att.linear_qkv, ColumnParallelLinear),
                            ("linear_proj", att.linear_proj, RowParallelLinear),
                            ("linear_fc1", mlp.linear_fc1, ColumnParallelLinear),
                            ("linear_fc2", mlp.linear_fc2, RowParallelLinear)):
        if type(lin) is not cls:
            raise _refuse(f"{where} is {type(lin).__name__}, not Megatron-Core's {cls.__name__} (local spec)")
    if not (_identity(att.q_layernorm) and _identity(att.k_layernorm)):
        raise _refuse("the layer has q/k layernorms (qk_layernorm); not modelled")
    for sub in ("pre_cross_attn_layernorm", "cross_attention"):
        if not _identity(getattr(layer, sub)):
            raise _refuse(f"the layer has a {sub}; only decoder self-attention layers are modelled")
    cfg = layer.config
    return LayerParts(layer=layer, config=cfg, input_layernorm=layer.input_layernorm,
                      pre_mlp_layernorm=layer.pre_mlp_layernorm, attention=att, core=core, mlp=mlp,
                      heads=int(att.num_attention_heads_per_partition),
                      groups=int(att.num_query_groups_per_partition),
                      head_dim=int(att.hidden_size_per_attention_head), global_index=int(layer.layer_number) - 1)


def rng_tracker() -> Any:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker  # type: ignore[import-untyped]

    return get_cuda_rng_tracker()


@dataclass(frozen=True)
class RngState:
    """The generator states a dropout op drew from (as Megatron's CheckpointFunction stashes them)."""

    cpu: torch.Tensor
    device: torch.Tensor
    tracker: dict[str, Any]


def rng_capture() -> RngState:
    from megatron.core.tensor_parallel import random as mrandom

    return RngState(torch.get_rng_state(), mrandom._get_cuda_rng_state(), rng_tracker().get_states())


@contextlib.contextmanager
def rng_replay(state: RngState) -> Iterator[None]:
    """Run with the generators as `state` has them, then put back the current ones (a recomputation draws the
    same dropout mask and leaves every generator as it found it)."""
    from megatron.core.tensor_parallel import random as mrandom

    now = rng_capture()
    torch.set_rng_state(state.cpu)
    mrandom._set_cuda_rng_state(state.device)
    rng_tracker().set_states(dict(state.tracker))
    try:
        yield
    finally:
        torch.set_rng_state(now.cpu)
        mrandom._set_cuda_rng_state(now.device)
        rng_tracker().set_states(now.tracker)


def rotary(parts: LayerParts, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's RoPE on one of query / key, as SelfAttention.forward applies it (training, no packing)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb  # type: ignore[import-untyped]
    from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config

    out: torch.Tensor = apply_rotary_pos_emb(t, freqs, config=parts.config, cu_seqlens=None,
                                             mscale=_yarn_get_concentration_factor_from_config(parts.config),
                                             cp_group=parts.attention.pg_collection.cp)
    return out


def bda(parts: LayerParts, which: str) -> Any:
    """The layer's bias-dropout-add function for the attention (``"attn"``) or MLP residual."""
    mod = parts.layer.self_attn_bda if which == "attn" else parts.layer.mlp_bda
    return mod(parts.layer.training, parts.config.bias_dropout_fusion)


def global_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Megatron's global memory buffer (what DotProductAttention hands baddbmm as its ignored input)."""
    from megatron.core import parallel_state  # type: ignore[import-untyped]

    out: torch.Tensor = parallel_state.get_global_memory_buffer().get_tensor(shape, dtype, "mpu")
    return out


def run_pre_hooks(module: Any, x: torch.Tensor) -> None:
    """Run the forward pre-hooks registered on one of the layer's linears, which lynx's engine computes without
    calling the module. Megatron's DDP registers one on every submodule with ``overlap_param_gather``: it waits
    for (and dispatches) the all-gather of the bucket holding the module's parameters, which the distributed
    optimizer has updated only in this rank's shard; skipping it would read another rank's stale values. Reads
    torch's private hook tables (``Module.__call__`` offers no way to run the hooks alone); a hook that would
    replace the input is refused, as the engine cannot honour it."""
    for hid, hook in list(module._forward_pre_hooks.items()):
        out = hook(module, (x,), {}) if hid in module._forward_pre_hooks_with_kwargs else hook(module, (x,))
        if out is not None:
            raise TypeError(f"lynx.integrations.megatron: a forward pre-hook on {type(module).__name__} "
                            "replaces its input; lynx's engine computes the layer's linears itself and cannot "
                            "apply it")

