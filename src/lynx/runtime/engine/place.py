"""Where a restoration runs, as types: `Place` (a window of the plan's phases 1-4, the cool-down stall, FSDP's
backward all-gather, or on demand) and `Direction` (the forward or the backward collective a layer opens a window
in). The place's value is the key the engine's statistics and `lynx train`'s report count restorations under."""

from __future__ import annotations

from enum import Enum

from lynx.decisions import Phase
from lynx.runtime.engine.restore_plan import BWD_PHASE, FWD_PHASE
from lynx.runtime.layers.base import Direction

__all__ = ["BWD_PHASE", "FWD_PHASE", "Direction", "Place"]


class Place(Enum):
    FWD_ATTN = "fwd_attn"
    FWD_MLP = "fwd_mlp"
    BWD_MLP = "bwd_mlp"
    BWD_ATTN = "bwd_attn"
    COOLDOWN = "cooldown"
    """The cool-down stall: before waiting for the next stage's gradient, with no forward left to host."""
    FSDP_BWD = "fsdp_bwd"
    """Inside FSDP2's backward all-gather: after the layer's pre-backward unshard, with the gather of the layer
    below (FSDP's backward prefetch) in flight; the layer's own pending work (the planner's
    `cost.pricing.fsdp_window`, decision 0240)."""
    ON_DEMAND = "on_demand"
    """When backward unpacks a tensor not restored yet (phase 5, or what no window restored)."""

    @property
    def in_window(self) -> bool:
        return self is not Place.ON_DEMAND

    @staticmethod
    def of(phase: Phase) -> Place:
        """The window place of a phase-1..4 op."""
        return _OF_PHASE[phase]


_OF_PHASE = {Phase.FWD_ATTN: Place.FWD_ATTN, Phase.FWD_MLP: Place.FWD_MLP, Phase.BWD_MLP: Place.BWD_MLP,
             Phase.BWD_ATTN: Place.BWD_ATTN}
