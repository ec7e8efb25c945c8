"""Offloading a saved tensor: the third choice beside keeping and recomputing (issue 22; Megatron-Core's
fine-grained activation offloading copies a module's input to the host after its forward and back before
its backward).

One `OffloadEntry` per storage: the whole storage is copied byte for byte into a host buffer (pinned when
CUDA is available, so the copy can be asynchronous) on a device-to-host side stream, and the device storage
is then released by autograd (it holds a small `OffloadHandle` instead). `start_reload` copies it back on a
host-to-device side stream into a fresh device buffer; the engine starts it one layer ahead of the backward
that reads it (a prefetch), and `fetch` makes the compute stream wait for it. The bytes are the same bytes,
so gradients are bitwise those of keeping the tensor. On the CPU the "device" is the host: the same code
path, synchronous copies, no streams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class OffloadHandle:
    """What autograd holds instead of an offloaded tensor: its record, its storage and its view of it."""

    layer: int
    mb: int
    key: int
    """The device storage's key at offload time (`ledger.storage_key`), unique in its record."""
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under `t` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def view_of(buf: torch.Tensor, h: OffloadHandle) -> torch.Tensor:
    """The tensor `h` stands for, on the reloaded byte buffer `buf`."""
    return torch.empty(0, dtype=h.dtype, device=buf.device).set_(buf.untyped_storage(), h.offset, h.size, h.stride)


class Streams:
    """The side streams of one device (CUDA): device-to-host and host-to-device copies, off the compute stream."""

    def __init__(self) -> None:
        self._by_device: dict[int, tuple[Any, Any]] = {}

    def of(self, device: torch.device) -> tuple[Any, Any]:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._by_device:
            self._by_device[idx] = (torch.cuda.Stream(device=idx), torch.cuda.Stream(device=idx))
        return self._by_device[idx]


class OffloadEntry:
    """One storage copied out to the host and, later, back."""

    def __init__(self, t: torch.Tensor, streams: Streams) -> None:
        src = _bytes_of(t)
        self.nbytes = int(src.numel())
        self.label = ""
        """Which op, layer and micro-batch it belongs to (the engine's trace names it so)."""
        self.device = t.device
        self._streams = streams
        self._cuda = t.device.type == "cuda"
        # pinned (page-locked) only where a CUDA driver exists: the asynchronous copies need it
        self.host: torch.Tensor | None = torch.empty(self.nbytes, dtype=torch.uint8,
                                                     pin_memory=torch.cuda.is_available())
        self.reloaded: torch.Tensor | None = None
        self._out_event: Any = None
        self._in_event: Any = None
        self.fetched = False
        if self._cuda:
            d2h, _ = streams.of(t.device)
            d2h.wait_stream(torch.cuda.current_stream(t.device))  # the tensor is complete on the compute stream
            with torch.cuda.stream(d2h):
                self.host.copy_(src, non_blocking=True)
                self._out_event = torch.cuda.Event()
                self._out_event.record(d2h)
            src.record_stream(d2h)  # the allocator must not reuse the storage before the copy is done
        else:
            self.host.copy_(src)

    def start_reload(self) -> None:
        """Copy back to the device (asynchronous on CUDA); idempotent."""
        if self.reloaded is not None:
            return
        assert self.host is not None
        if self._cuda:
            _, h2d = self._streams.of(self.device)
            h2d.wait_event(self._out_event)
            with torch.cuda.stream(h2d):
                buf = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                buf.copy_(self.host, non_blocking=True)
                self._in_event = torch.cuda.Event()
                self._in_event.record(h2d)
            self.reloaded = buf
        else:
            buf = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            buf.copy_(self.host)
            self.reloaded = buf

    def fetch(self) -> torch.Tensor:
        """The reloaded bytes, ready for the compute stream (starts the reload if no prefetch did)."""
        self.start_reload()
        buf = self.reloaded
        assert buf is not None
        if not self.fetched:
            if self._cuda:
                cur = torch.cuda.current_stream(self.device)
                cur.wait_event(self._in_event)
                buf.record_stream(cur)
            self.host = None  # the host copy is no longer needed
            self.fetched = True
        return buf

