"""The runtime side of the family seam: a plan's model family picks its torch layer and model.

Each family's runtime module (named by `lynx.families.base.Family.runtime_module`) defines ``RUNTIME``, a
`RuntimeFamily`; nothing in the runtime, the profiler or `lynx train` names a family."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lynx.runtime.layers.base import RuntimeLayer
from lynx.runtime.layers.ends import ModelEnds
from lynx.spec import ModelSpec, ParallelSpec

if TYPE_CHECKING:
    from lynx.runtime.layers.mtp import MultiTokenPrediction


@dataclass(frozen=True)
class RuntimeFamily:
    config: Callable[[ModelSpec, ParallelSpec, torch.dtype, bool], Any]
    """(model, layout, dtype, core_attn) -> the layer config (core_attn: GPT's SDPA switch)."""
    layer: Callable[..., RuntimeLayer]
    """(cfg, group, layer_index=, device=, seed=) -> one layer with run_op / op_names / op_inputs / op_blocks."""
    model: Callable[..., torch.nn.Module]
    """(cfg, num_layers, vocab, group, device=, seed=) -> embeddings + layers + head + loss."""
    op_names: Callable[[Any], tuple[str, ...]]
    ends: ModelEnds
    """The embedding and the final norm + LM head (`lynx.runtime.layers.ends`)."""
    experts: bool = False
    """Its layers take the expert-parallel group (`layer(..., ep_group=)`, `model(..., ep_group=)`)."""
    mtp: Callable[..., MultiTokenPrediction | None] | None = None
    """(cfg, group, device=, seed=, ep_group=) -> the last stage's multi-token-prediction block
    (`lynx.runtime.layers.mtp`), None when the model has none; None: the family has no MTP."""
    kind_op_names: Callable[[Any, str], tuple[str, ...]] | None = None
    """(cfg, layer kind) -> the op names of that kind's runtime layer, for a stack of several kinds (`lynx.stack`);
    None: one kind (`op_names`)."""


def runtime_for(model: ModelSpec) -> RuntimeFamily:
    return runtime_of_family(model.family)


def runtime_of(cfg: Any) -> RuntimeFamily:
    """The family of a runtime layer config (each config class names its family)."""
    return runtime_of_family(str(cfg.family))


def runtime_of_family(name: str) -> RuntimeFamily:
    from lynx.errors import SpecError
    from lynx.families import family_names, get_family

    module = get_family(name).runtime_module
    if not module:
        built = ", ".join(f for f in family_names() if get_family(f).runtime_module)
        target = "lynx export torchtitan" if name == "torchtitan-llama3" else "lynx export megatron"
        raise SpecError(f"family {name!r} has no runtime layer: lynx train builds {built} layers; plan and export "
                        f"this model (lynx plan, {target}), or train a {built.split(', ')[0]} model")
    mod = importlib.import_module(module)
    rt: RuntimeFamily = mod.RUNTIME
    return rt
