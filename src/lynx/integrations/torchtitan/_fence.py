"""The one module of lynx.integrations.torchtitan that touches anything private: torchtitan's block layout (its
attribute names are not an API), torch's ``TorchDispatchMode`` (``torch.utils._python_dispatch``), and the
version pins. Everything else in the package goes through here.

Tested with torchtitan 0.3.0 and torch 2.13; other versions are refused with one line naming both (set
``LYNX_TORCHTITAN_UNPINNED=1`` to try anyway: the parity tests in tests/integration/test_torchtitan_*.py say
whether the block still computes what torchtitan computes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

TESTED = {"torchtitan": "0.3.0", "torch": "2.13"}


# Submodule of torchtitan 0.3.0's Llama3TransformerBlock -> the lynx op it computes (families.titan).
MODULE_OPS: dict[str, str] = {
    "attention_norm": "rmsnorm1", "attention.qkv_linear": "qkv", "attention.rope": "rope",
    "attention.inner_attention": "core_attn", "attention.wo": "attn_proj", "ffn_norm": "rmsnorm2",
    "feed_forward.w1": "gate", "feed_forward.w3": "up", "feed_forward.w2": "down",
}
# Ops run directly in a parent module: (module, aten op name, k-th call) -> lynx op. FusedQKVLinear copies
# q, k, v out of the fused GEMM (three clones, V last); FeedForward computes silu(w1 x) * w3 x itself.
LOOSE_OPS: dict[tuple[str, str, int], str] = {
    ("attention.qkv_linear", "clone", 0): "q_copy", ("attention.qkv_linear", "clone", 1): "k_copy",
    ("attention.qkv_linear", "clone", 2): "v_copy", ("feed_forward", "silu", 0): "silu",
    ("feed_forward", "mul", 0): "swiglu",
}


class TorchtitanVersionError(RuntimeError):
    pass


def check_versions() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        titan = version("torchtitan")
    except PackageNotFoundError:
        raise TorchtitanVersionError("lynx.integrations.torchtitan: torchtitan is not installed") from None
    have = {"torchtitan": titan, "torch": torch.__version__}
    bad = [f"{k} {have[k]} (tested: {v})" for k, v in TESTED.items() if not have[k].startswith(v)]
    if bad and os.environ.get("LYNX_TORCHTITAN_UNPINNED") != "1":
        raise TorchtitanVersionError(
            "lynx.integrations.torchtitan: untested " + ", ".join(bad) + "; it reads torchtitan's block layout "
            "(lynx/integrations/torchtitan/_fence.py). Set LYNX_TORCHTITAN_UNPINNED=1 to try anyway")


def dispatch_mode_base() -> type:
    """torch's TorchDispatchMode (a private module in torch 2.13)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


@dataclass(frozen=True)
class BlockParts:
    """What lynx needs of one torchtitan 0.3.0 Llama3TransformerBlock (local shards after TP)."""

    dim: int
    norm1_weight: nn.Parameter
    norm1_eps: float | None
    norm2_weight: nn.Parameter
    norm2_eps: float | None
    wqkv: nn.Parameter
    wo: nn.Parameter
    w1: nn.Parameter
    w2: nn.Parameter
    w3: nn.Parameter
    heads_per_kv: int
    r_dim: int
    head_dim: int
    n_heads: int
    n_kv_heads: int
    scaling: float | None
    enable_gqa: bool
    rope: nn.Module
    inner_attention: nn.Module
    module: nn.Module | None = None
    """The block itself: `weights` reads its parameters when an op runs (FSDP2 swaps them per call)."""


def block_parts(block: nn.Module) -> BlockParts:
    """Read a torchtitan Llama 3 block; a clear error when it is not shaped like 0.3.0's."""
    b: Any = block  # torchtitan's modules, read by attribute name (not typed: not an API)
    try:
        att, ffn = b.attention, b.feed_forward
        qkv = att.qkv_linear
        parts = BlockParts(
            dim=int(b.attention_norm.normalized_shape[0]),
            norm1_weight=b.attention_norm.weight, norm1_eps=b.attention_norm.eps,
            norm2_weight=b.ffn_norm.weight, norm2_eps=b.ffn_norm.eps,
            wqkv=qkv.wqkv.weight, wo=att.wo.weight, w1=ffn.w1.weight, w2=ffn.w2.weight, w3=ffn.w3.weight,
            heads_per_kv=int(qkv.heads_per_kv), r_dim=int(qkv.r_dim), head_dim=int(att.head_dim),
            n_heads=int(att.n_heads), n_kv_heads=int(att.n_kv_heads), scaling=att.scaling,
            enable_gqa=bool(att.enable_gqa), rope=att.rope, inner_attention=att.inner_attention, module=block,
        )
    except AttributeError as e:
        raise TypeError(f"lynx.integrations.torchtitan: {type(block).__name__} is not torchtitan 0.3.0's "
                        f"Llama3TransformerBlock with a fused QKV projection ({e})") from None
    for name in ("q_norm", "k_norm"):
        if getattr(att, name, None) is not None:
            raise TypeError(f"lynx.integrations.torchtitan: the block has {name} (Qwen3-style); not modelled")
    if not is_fsdp(block):  # FSDP2's sharded parameters are DTensors; `weights` reads the unsharded ones
        for p in (parts.wqkv, parts.wo, parts.w1, parts.w2, parts.w3):
            if is_dtensor(p):
                raise TypeError("lynx.integrations.torchtitan: DTensor parameters (parallelism.spmd_backend "
                                "partial_dtensor/full_dtensor) are not supported; use torchtitan 0.3.0's default "
                                "spmd_types backend")
    return parts


def is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "placements")


WEIGHTS = ("norm1", "norm2", "wqkv", "wo", "w1", "w2", "w3")


def _read_weights(b: Any) -> dict[str, torch.Tensor]:
    att, ffn = b.attention, b.feed_forward
    return {"norm1": b.attention_norm.weight, "norm2": b.ffn_norm.weight, "wqkv": att.qkv_linear.wqkv.weight,
            "wo": att.wo.weight, "w1": ffn.w1.weight, "w2": ffn.w2.weight, "w3": ffn.w3.weight}


def weights(parts: BlockParts, on_unshard: Any = None) -> dict[str, torch.Tensor]:
    """The block's parameters as its forward sees them now. Without FSDP: the parameters themselves. With
    FSDP2 (``fully_shard``): inside the block's forward or backward, the unsharded parameters FSDP put on the
    module; outside them (a restoration in another block's window, or in a cool-down stall) the module holds
    its sharded DTensors, and the block is unsharded first (``FSDPModule.unshard``, public; FSDP's own
    pre-backward then finds it unsharded and its post-backward reshards it), calling `on_unshard()`."""
    if parts.module is None:
        return {"norm1": parts.norm1_weight, "norm2": parts.norm2_weight, "wqkv": parts.wqkv, "wo": parts.wo,
                "w1": parts.w1, "w2": parts.w2, "w3": parts.w3}
    w = _read_weights(parts.module)
    if any(is_dtensor(t) for t in w.values()):
        if not is_fsdp(parts.module):
            raise TypeError("lynx.integrations.torchtitan: a block's parameters became DTensors after the plan "
                            "was applied")
        parts.module.unshard()  # type: ignore[operator]
        if on_unshard is not None:
            on_unshard()
        w = _read_weights(parts.module)
        if any(is_dtensor(t) for t in w.values()):
            raise TypeError("lynx.integrations.torchtitan: FSDP's unsharded parameters are DTensors (FSDP over a "
                            "DTensor tensor-parallel mesh); use the spmd_types backend")
    return w


def rope(parts: BlockParts, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None) -> Any:
    """torchtitan's RoPE module on (q, k) (its forward, without the module's hooks)."""
    return parts.rope.forward(q, k, positions)


def inner_attention(parts: BlockParts, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: Any) -> Any:
    """torchtitan's inner attention (SDPA or FlexAttention), as GQAttention.forward calls it."""
    return parts.inner_attention.forward(q, k, v, attention_masks=masks, scale=parts.scaling,
                                         enable_gqa=parts.enable_gqa)


def is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


# -- what torchtitan parallelized (read at apply time by `checks`) ------------------------------------------------

LINEARS = ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
"""The block's GEMMs: lynx's engine calls their weights directly (``F.linear``), as ``nn.Linear.forward`` does."""
ATTENTION_KERNELS = ("ScaledDotProductAttention", "FlexAttention")
"""torchtitan 0.3.0's inner attention modules the family prices (fused: output and log-sum-exp kept)."""


def parallel_dims_of(model_part: nn.Module) -> Any:
    """The ``ParallelDims`` torchtitan parallelized the part with, or None: ``Module.parallelize`` wraps each
    module with a sharding config in a ``forward_with_redistribution`` closure over it (not an API: the cell
    is read by name)."""
    for m in model_part.modules():
        fn: Any = m.__dict__.get("forward")
        code = getattr(fn, "__code__", None)
        if code is not None and "parallel_dims" in code.co_freevars and fn.__closure__ is not None:
            return fn.__closure__[code.co_freevars.index("parallel_dims")].cell_contents
    return None


def _axes(spec: Any) -> list[str]:
    if isinstance(spec, (tuple, list)):
        return [a for s in spec for a in _axes(s)]
    return [] if spec is None else [str(getattr(spec, "value", spec))]


def sequence_parallel_of(block: nn.Module) -> bool | None:
    """Whether torchtitan's module plan for the block's attention norm takes sequence shards (its input layout's
    partition spec splits the sequence over the TP axis: ``set_llama3_sharding_config(enable_sp=True)``);
    None when the norm has no plan."""
    sc = getattr(getattr(block, "attention_norm", None), "_sharding_config", None)
    if sc is None:
        return None
    layout = (getattr(sc, "in_src_shardings", None) or {}).get("input")
    return "tp" in _axes(getattr(layout, "partition_spec", None))


def linear_classes(block: nn.Module) -> dict[str, type]:
    """FQN inside the block -> class of each GEMM module."""
    return {name: type(block.get_submodule(name)) for name in LINEARS}


def runs_linear_forward(cls: type) -> bool:
    """The module computes ``F.linear(x, weight, bias)`` (torch's or torchtitan's Linear), as the engine does."""
    return getattr(cls, "forward", None) is nn.Linear.forward


def attention_kernel(block: nn.Module) -> str:
    return type(block.get_submodule("attention.inner_attention")).__name__


def is_compiled(block: nn.Module) -> bool:
    """``nn.Module.compile`` (what torchtitan's apply_compile calls) or a ``torch.compile`` wrapper."""
    return getattr(block, "_compiled_call_impl", None) is not None or type(block).__name__ == "OptimizedModule"


def register_fake_backend() -> None:
    """torch's "fake" process-group backend, on which torchtitan's ParallelDims puts mesh dimensions of degree
    1: registered by a private torch module (torch.testing._internal.distributed.fake_pg) that a plain process
    has not imported."""
    import torch.distributed as dist

    if "FAKE" not in getattr(dist.Backend, "_plugins", {}):
        import torch.testing._internal.distributed.fake_pg  # noqa: F401
