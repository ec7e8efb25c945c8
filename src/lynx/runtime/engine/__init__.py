"""The recompute engine: saved-tensor hooks, restoration at a typed place, and the byte ledger."""

from lynx.runtime.engine.core import EngineStats, RecomputeEngine

__all__ = ["EngineStats", "RecomputeEngine"]
