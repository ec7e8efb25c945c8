"""What the simulator returns: Gantt segments, per-stage results and the iteration's metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class SegmentKind(str, Enum):
    """Bars of the Gantt chart."""

    F = "F"
    B = "B"
    RECOMPUTE = "recompute"
    """Recomputation on demand, on the critical path."""
    OVERLAP = "overlap"
    """Recomputation hidden in a collective window or a pipeline stall."""
    STALL = "stall"
    COPY_OUT = "copy-out"
    """An offloaded activation's device-to-host copy (its own stream, beside compute)."""
    RELOAD = "reload"
    """Its host-to-device copy before the backward that reads it."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One bar of the Gantt chart."""

    stage: int
    kind: SegmentKind
    microbatch: int
    start: float
    end: float
    chunk: int = 0


@dataclass(frozen=True, slots=True)
class StageResult:
    stage: int
    num_layers: int
    fwd_time_s: float
    bwd_time_s: float
    busy_time_s: float
    """Compute-unit busy time in one iteration (forward, backward, exposed recomputation)."""
    peak_memory_bytes: float
    budget_bytes: float
    static_bytes: float
    recompute_critical_s: float
    """Recomputation on the critical path, summed over the iteration's micro-batches."""
    recompute_overlapped_s: float
    """Recomputation hidden in collective windows or pipeline stalls."""
    recompute_total_s: float
    copy_exposed_s: float = 0.0
    """Offload copies the stage waited for (not hidden behind compute), summed over the iteration."""
    offloaded_bytes: float = 0.0
    """Bytes one micro-batch offloads on the stage (each way)."""
    host_bytes: float = 0.0
    """Pinned host memory the stage's offloaded activations take per GPU."""

    @property
    def oom(self) -> bool:
        return self.peak_memory_bytes > self.budget_bytes * (1 + 1e-9)


@dataclass(frozen=True, slots=True)
class SimResult:
    iteration_time_s: float
    pipeline_time_s: float
    """From the first forward to the last backward (no DP all-reduce / optimizer)."""
    samples_per_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    stages: tuple[StageResult, ...]
    segments: tuple[Segment, ...] = ()
    memory_curves: tuple[tuple[tuple[float, float], ...], ...] = field(default=())
    """Per stage, (time, bytes) after every event."""

    @property
    def oom(self) -> bool:
        return any(s.oom for s in self.stages)

    @property
    def recompute_critical_s(self) -> float:
        return max((s.recompute_critical_s for s in self.stages), default=0.0)

    @property
    def copy_exposed_s(self) -> float:
        """Offload copies waited for, on the stage that waits most (docs/offload.md)."""
        return max((s.copy_exposed_s for s in self.stages), default=0.0)

    @property
    def offloads(self) -> bool:
        return any(s.offloaded_bytes > 0 for s in self.stages)

    @property
    def recompute_hidden_s(self) -> float:
        """Recomputation hidden in collective windows and pipeline stalls, on the stage that hides most."""
        return max((s.recompute_overlapped_s for s in self.stages), default=0.0)
