"""`lynx train` under torch FSDP2 (`fully_shard`): a plan whose data parallelism is `--use-torch-fsdp2`.

What runs: every layer of the (one) stage is its own FSDP unit (`fully_shard(layer)`, reshard_after_forward as
the plan prices it: `DpSharding.reshards`), then the stage itself (the embedding, the final norm and the head, the
root unit), over the plan's DP group. The engine still runs each layer op by op, but from the layer's own call
(`OpLayer.step`), so FSDP2's pre-forward unshard, post-forward reshard and pre-backward hooks see every layer. No
torch code is edited: the seams are public (`fully_shard`, `FSDPModule.unshard`) plus a tensor hook on each
layer's output registered after FSDP2's own.

Where recomputation runs (decision 0240, `lynx.cost.pricing.fsdp_window`): FSDP2 registers its pre-backward on
the layer's output (`Tensor.register_hook`, torch's `_fsdp_state._register_pre_backward_hook`); hooks on a tensor
run in the order they were registered, so the hook lynx adds after the layer's call runs right after FSDP2's
pre-backward: the layer's parameters are gathered and the gather of the layer below (FSDP2's backward prefetch)
has been issued. There the engine restores the layer's pending work (`Place.FSDP_BWD`, counted in
`EngineStats.by_window["fsdp_bwd"]`): what would otherwise run on demand inside the layer's backward.

A restoration outside its layer's own call (a Megatron-uniform chunk replaying the layer below) finds that layer
sharded; `live_params` unshards it first (`FSDPModule.unshard`; FSDP2's own pre-backward then finds it gathered).

Supported: TP 1, PP 1, DP > 1, no HSDP, torch FSDP2 (Megatron-FSDP's strategies are not this wrapper). Anything else is
refused before any process starts (`check_fsdp`, one line, exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lynx.cost.fsdp import DpMode, DpSharding
from lynx.errors import PlanFormatError
from lynx.runtime.layers.base import OpLayer


@dataclass(frozen=True, slots=True)
class FsdpRun:
    """How `lynx train` wraps the stage in FSDP2."""

    reshard_after_forward: bool
    """Each layer's gathered parameters are freed after its forward (and gathered again before its backward)."""


def check_fsdp(path: str, ds: DpSharding, tp: int, pp: int, vpp: int, cp: int, dp: int) -> FsdpRun | None:
    """The FSDP2 run a plan asks for (None: DDP), or one `PlanFormatError` line naming what is not supported."""
    if not ds.fsdp:
        return None
    if ds.mode is not DpMode.TORCH_FSDP2:
        raise PlanFormatError(f"{path}: the plan shards data parallelism with Megatron-FSDP "
                              f"(--data-parallel-sharding-strategy {ds.strategy.value}); lynx train runs torch FSDP2 "
                              "only: plan with --use-torch-fsdp2")
    unsupported = [f"{name} {v}" for name, v in (("TP", tp), ("PP", pp), ("VPP", vpp), ("CP", cp)) if v > 1]
    if ds.instances > 1:
        unsupported.append(f"HSDP replicas {ds.instances}")
    if dp < 2:
        unsupported.append(f"DP {dp} (nothing to shard over)")
    if unsupported:
        raise PlanFormatError(f"{path}: lynx train runs FSDP2 plans at TP 1, PP 1, CP 1, DP > 1 without HSDP; "
                              f"this plan has {', '.join(unsupported)}")
    return FsdpRun(reshard_after_forward=ds.reshards(pp))


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class LiveParams:
    """`RecomputeEngine(live_params=...)` for FSDP2-wrapped layers: the parameters layer li reads now, unsharded
    first when FSDP holds them sharded (`unshards` counts those, per layer)."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers = layers
        self.unshards = [0] * len(layers)

    def __call__(self, li: int) -> list[torch.Tensor]:
        layer = self.layers[li]
        ps: list[torch.Tensor] = list(layer.parameters())
        if any(_is_dtensor(p) for p in ps):
            layer.unshard()  # type: ignore[operator]  # FSDPModule.unshard (public)
            self.unshards[li] += 1
            ps = list(layer.parameters())
        return ps


def shard_stage(stage: Any, group: Any, run: FsdpRun) -> LiveParams | None:
    """Wrap `stage` (a `StageModule`) in FSDP2 over `group` as the module docstring says; route its layers'
    calls through its engine. Returns the engine's live-parameter callback (None without an engine)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device = next(stage.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device)
    layers = list(stage.layers.values())
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=run.reshard_after_forward)
    fully_shard(stage, mesh=mesh, reshard_after_forward=run.reshard_after_forward)
    engine = stage.engine
    if engine is None:
        return None
    live = LiveParams(layers)
    local = [p.to_local() if _is_dtensor(p) else p for p in stage.parameters()]
    engine.use_live_params(live, local)
    for li, layer in enumerate(layers):
        if not isinstance(layer, OpLayer):
            raise TypeError(f"layer {li}: FSDP needs an OpLayer (its call hands the step to the engine)")
        layer.step = _step(stage, li)
    return live


def _step(stage: Any, li: int) -> Any:
    def step(x: torch.Tensor, mb: int) -> torch.Tensor:
        out: torch.Tensor = stage.engine.forward_layer(li, x, mb, stage.hosts, stage.guest)
        return out
    return step


def window_after_pre_backward(engine: Any, li: int, y: torch.Tensor, mb: int) -> None:
    """Register, on layer li's output `y` (FSDP2's pre-backward hook is on it already), the hook that restores the
    layer's pending work for micro-batch `mb` once FSDP2 has gathered the layer for its backward."""
    if engine is None or not y.requires_grad:
        return

    def hook(g: torch.Tensor) -> None:
        engine.fsdp_window(li, mb)

    y.register_hook(hook)
