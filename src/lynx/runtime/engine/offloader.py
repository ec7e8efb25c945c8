"""The engine's offload manager: what a policy offloads goes to the host when autograd saves it (once per
storage) and comes back one layer ahead of the backward that reads it (a prefetch), or when that backward
asks first; the ledger drops the bytes while they are out and takes them back when the copy back starts.
The copies themselves are `offload.OffloadEntry`'s."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from lynx.runtime.engine.ledger import Ledger, Record, storage_key
from lynx.runtime.engine.offload import OffloadEntry, OffloadHandle, Streams, view_of
from lynx.runtime.engine.stats import EngineStats

Tracer = Callable[[str, float, float], None]


class Offloader:
    """Offloading for one engine: `records` is the engine's live (layer, micro-batch) records."""

    def __init__(self, records: Mapping[tuple[int, int], Record], ledger: Ledger, stats: EngineStats,
                 on_reload: Callable[[], None]) -> None:
        self._records, self._ledger, self._stats, self._on_reload = records, ledger, stats, on_reload
        self._streams = Streams()
        self.tracer: Tracer | None = None
        """Called as tracer(name, t0, t1) for every copy out ("d2h ...") and back ("h2d ..."): the host time the
        copy took to issue (on the CPU the whole synchronous copy; on CUDA the launch on the side stream)."""

    def offload(self, li: int, mb: int, op: str, t: torch.Tensor) -> OffloadHandle:
        """Autograd saves `t` (owned by op of layer li, micro-batch mb), which the policy offloads: copy its
        storage to the host once per record, and hand autograd a handle."""
        rec = self._records[(li, mb)]
        key = storage_key(t)
        if key not in rec.offloaded:
            t0 = time.perf_counter()
            entry = OffloadEntry(t, self._streams)
            entry.label = f"{op} L{li} mb{mb}"
            if self.tracer is not None:
                self.tracer(f"d2h {entry.label} {entry.nbytes} B", t0, time.perf_counter())
            rec.offloaded[key] = entry
            rec.offload_pins.append(t)
            self._stats.offloaded_bytes += entry.nbytes
            self._stats.host(entry.nbytes)
        return OffloadHandle(li, mb, key, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)

    def start_reload(self, rec: Record, entry: OffloadEntry) -> None:
        """Copy `entry` back to the device; its bytes return to the ledger now."""
        if entry.reloaded is not None:
            return
        t0 = time.perf_counter()
        entry.start_reload()
        if self.tracer is not None:
            self.tracer(f"h2d {entry.label} {entry.nbytes} B", t0, time.perf_counter())
        assert entry.reloaded is not None
        self._ledger.acquire(rec, entry.reloaded)
        self._stats.reloaded_bytes += entry.nbytes
        self._stats.host(-entry.nbytes)
        self._on_reload()

    def prefetch(self, li: int, mb: int) -> None:
        """The top layer li's backward is starting: start copying back what it and the layer below read (later
        layers' reloads start as each backward ends, `reload_layer`: one layer ahead)."""
        self.reload_layer(li, mb)
        self.reload_layer(li - 1, mb)

    def reload_layer(self, li: int, mb: int) -> None:
        """Start copying back everything (layer li, micro-batch mb) offloaded, ahead of its backward."""
        rec = self._records.get((li, mb))
        if rec is None:
            return
        for entry in rec.offloaded.values():
            if entry.reloaded is None:
                self._stats.reloads_prefetched += 1
                self.start_reload(rec, entry)

    def reloaded(self, h: OffloadHandle) -> torch.Tensor:
        """What an offload handle stands for, back on the device (waiting for its copy)."""
        rec = self._records[(h.layer, h.mb)]
        entry = rec.offloaded[h.key]
        if entry.reloaded is None:
            self._stats.reloads_on_demand += 1
            self.start_reload(rec, entry)
        return view_of(entry.fetch(), h)

    def forget(self, rec: Record) -> None:
        """The record's backward ran (or the step ended): what is still on the host is dropped."""
        self._stats.host(-sum(e.nbytes for e in rec.offloaded.values() if e.reloaded is None))
        rec.offloaded.clear()
