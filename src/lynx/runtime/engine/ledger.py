"""The engine's byte ledger: what it holds for backward per (layer, micro-batch) record, and a running total
of the bytes in live records, each storage once.

A running total kept up to date as records gain and lose tensors: recomputing it by scanning every record
after each restoration cost more Python time than some restorations themselves (docs/runtime-overhead.md).
`held_bytes_scan` is the definition; tests compare the two."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@dataclass
class Record:
    """What the engine holds for one (layer, micro-batch) between its forward and its backward."""

    input: torch.Tensor | None
    input_rg: bool
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)
    """storage key -> bytes of the tensors autograd holds as themselves (activations only)."""
    restored: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)
    out_layout: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    out_handles: set[str] = field(default_factory=set)
    """Ops whose output (or a view of it) autograd holds as a handle: backward will ask for it."""
    refs: dict[int, int] = field(default_factory=dict)
    """storage key -> how many times this record counts it in the ledger's running total."""
    offloaded: dict[int, Any] = field(default_factory=dict)
    """device storage key at offload time -> its `OffloadEntry` (copied to the host; not in the running total
    until reloaded)."""
    offload_pins: list[torch.Tensor] = field(default_factory=list)
    """Offloaded storages kept alive until the layer's forward ends, so no later tensor of the same forward
    reuses an address (the entries' keys) meanwhile."""
    out_meta: dict[str, tuple[int, tuple[int, ...], tuple[int, ...], int, torch.dtype]] = field(default_factory=dict)
    """Offloaded ops: (storage key, size, stride, offset, dtype) of the output, so a recomputation that reads it
    reloads it instead of recomputing it."""
    amp: tuple[str, bool, torch.dtype] | None = None
    """(device type, enabled, dtype) of autocast when the layer's forward ran: a recomputation replays under it
    (as `torch.utils.checkpoint` restores the autocast state), so mixed precision recomputes bit for bit."""


class Ledger:
    """Bytes held by live records; parameters (`param_keys`) are never counted."""

    def __init__(self, param_keys: set[int]) -> None:
        self.param_keys = param_keys
        self._live: dict[int, list[int]] = {}  # storage key -> [bytes, references from live records]
        self._total = 0

    def hold(self, rec: Record, key: int, t: torch.Tensor) -> None:
        """Autograd holds `t` itself for `rec`."""
        rec.held[key] = storage_bytes(t)
        self._ref(rec, key, rec.held[key])

    def acquire(self, rec: Record, t: torch.Tensor) -> None:
        """`rec` keeps `t` (a kept output, a checkpointed input, a restored tensor)."""
        key = storage_key(t)
        if key not in self.param_keys and t.numel():
            self._ref(rec, key, storage_bytes(t))

    def _ref(self, rec: Record, key: int, nbytes: int) -> None:
        rec.refs[key] = rec.refs.get(key, 0) + 1
        live = self._live.get(key)
        if live is None:
            self._live[key] = [nbytes, 1]
            self._total += nbytes
        else:
            live[1] += 1

    def unref(self, rec: Record, key: int, count: int = 1) -> None:
        if rec.refs.get(key, 0) < count:
            return
        rec.refs[key] -= count
        if not rec.refs[key]:
            del rec.refs[key]
        live = self._live[key]
        live[1] -= count
        if live[1] <= 0:
            self._total -= live[0]
            del self._live[key]

    def forget(self, rec: Record) -> None:
        for key, count in list(rec.refs.items()):
            self.unref(rec, key, count)

    def held_bytes(self) -> int:
        return self._total

    def held_bytes_scan(self, records: list[Record]) -> int:
        """`held_bytes` by scanning `records` (the definition)."""
        seen: dict[int, int] = {}
        for rec in records:
            seen.update(rec.held)
            tensors: list[torch.Tensor] = list(rec.kept.values())
            if rec.input is not None:
                tensors.append(rec.input)
            for out, saved in rec.restored.values():
                tensors.append(out)
                tensors.extend(saved)
            tensors.extend(e.reloaded for e in rec.offloaded.values() if e.reloaded is not None)
            for t in tensors:
                k = storage_key(t)
                if k not in self.param_keys:
                    seen[k] = storage_bytes(t)
        return sum(seen.values())
