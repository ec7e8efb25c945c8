"""Recomputation policy algorithms: one module per algorithm, one result type (`RecomputePolicy`)."""

from lynx.decisions import (
    LayerPolicy,
    Phase,
    RecomputePolicy,
    SolveStats,
    StageContext,
    check_policy,
    validate_layer_policy,
)

__all__ = [
    "LayerPolicy", "Phase", "RecomputePolicy", "SolveStats", "StageContext", "check_policy",
    "validate_layer_policy",
]
