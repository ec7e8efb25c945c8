"""What the engine counts: restorations by place and their seconds, the bytes it holds for backward, and the
bytes it copies to the host and back (`lynx train`'s report and the tests read these)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lynx.runtime.engine.place import Place


@dataclass
class EngineStats:
    ondemand_s: float = 0.0
    window_s: float = 0.0
    """Seconds of recomputation inside collective windows (phases 1-4) and cool-down stalls."""
    restored_in_window: int = 0
    restored_on_demand: int = 0
    cooldown_s: float = 0.0
    """Of `window_s`: recomputation issued in a cool-down stall, before waiting for the next stage's gradient."""
    by_window: dict[str, int] = field(default_factory=dict)
    """Ops restored per place: "fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn", "cooldown", "fsdp_bwd",
    "on_demand"."""
    by_collective: dict[str, int] = field(default_factory=dict)
    """Ops restored inside each collective's window, keyed "fwd <comm op>" / "bwd <comm op>" (e.g.
    "fwd dispatch_a2a"): which collective of a block hosted them (the cool-down and on-demand are not here)."""
    peak_bytes: int = 0
    """Peak activation bytes held for backward (saved tensors kept, plus restored ones), all micro-batches."""
    fwd_end_bytes: list[int] = field(default_factory=list)
    window_calls: int = 0
    offloaded_bytes: int = 0
    """Bytes copied to the host (each storage once per record)."""
    reloaded_bytes: int = 0
    host_bytes: int = 0
    """Bytes on the host now (copied out, not yet copied back)."""
    host_peak_bytes: int = 0
    reloads_prefetched: int = 0
    """Reloads started ahead of the backward that reads them (one layer ahead); the rest were started by it."""
    reloads_on_demand: int = 0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def count(self, place: Place, seconds: float) -> None:
        """One restoration at `place` that took `seconds`."""
        self.by_window[place.value] = self.by_window.get(place.value, 0) + 1
        if place is Place.ON_DEMAND:
            self.ondemand_s += seconds
            self.restored_on_demand += 1
            return
        self.window_s += seconds
        self.restored_in_window += 1
        if place is Place.COOLDOWN:
            self.cooldown_s += seconds

    def host(self, delta: int) -> None:
        """`delta` bytes more (or fewer) on the host now."""
        self.host_bytes += delta
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
