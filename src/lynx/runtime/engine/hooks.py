"""The engine's saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`): attribute every tensor
autograd saves to the op that owns it and hold either the tensor or a small `Handle`.

Attribution: a parameter is held as is; a tensor sharing storage with an op's output (the layer input is
the previous layer's last output) belongs to that op, and the handle records its view (size, stride, offset
from the output); anything else (a dropout mask, norm statistics) belongs to the op running when it was
saved, as the k-th tensor that op's forward saved. Unpacking a handle asks the engine to restore its op.
A tensor whose owner the policy offloads is copied to the host and held as an `OffloadHandle` (offload.py);
unpacking it asks the engine for the reloaded copy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lynx.graph import LAYER_INPUT
from lynx.runtime.engine.ledger import storage_key
from lynx.runtime.engine.offload import OffloadHandle


@dataclass(frozen=True, slots=True)
class Handle:
    """What autograd holds instead of a dropped tensor."""

    layer: int
    mb: int
    op: str
    index: int = -1
    """-1: a view of op's output (size, stride, offset below); k >= 0: the k-th tensor op's forward saved."""
    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    offset: int = 0


NO_OP = (-1, -1, "")


class SavedTensorHooks:
    """pack / unpack for one engine. `dropped(layer, op, output)`: does the policy drop that op's output
    (output=True) or its other saved tensors; `hold(layer, mb, key, t)`: autograd holds `t` for that record;
    `handed_out(layer, mb, op)`: backward will ask for op's output; `restored(handle)`: the tensor a handle
    stands for, restoring its op first."""

    def __init__(self, param_keys: set[int], dropped: Callable[[int, str, bool], bool],
                 hold: Callable[[int, int, int, torch.Tensor], None], handed_out: Callable[[int, int, str], None],
                 restored: Callable[[Handle], torch.Tensor],
                 offload: Callable[[int, int, str, torch.Tensor, bool], Any] | None = None,
                 reloaded: Callable[[Any], torch.Tensor] | None = None) -> None:
        self.param_keys = param_keys
        self._dropped, self._hold, self._handed_out, self._restored = dropped, hold, handed_out, restored
        self._offload, self._reloaded = offload, reloaded
        """`offload(layer, mb, op, t, output)`: a handle if the policy offloads that op (None otherwise; `output`:
        `t` is a view of op's output, else a tensor op's forward saved beside it, a mask or statistics);
        `reloaded(handle)`: the tensor back on the device."""
        self.current: tuple[int, int, str] = NO_OP
        """(layer, micro-batch, op) whose forward is running."""
        self.count = 0
        """Tensors the running op has saved so far (parameters too: the replay sees the same sequence)."""
        self.registry: dict[int, tuple[int, str, torch.Tensor]] = {}
        """storage key -> (layer, op, output) of this layer's outputs (and its input)."""

    def start_op(self, layer: int, mb: int, op: str) -> None:
        self.current, self.count = (layer, mb, op), 0

    def pack(self, t: torch.Tensor) -> Any:
        key = storage_key(t)
        k = self.count
        self.count += 1
        if key in self.param_keys:
            return t
        li, mb, cur = self.current
        owner = self.registry.get(key)
        if self._offload is not None:
            who = (owner[0], owner[1]) if owner is not None else (li, cur)
            if who[1] != LAYER_INPUT:
                off = self._offload(who[0], mb, who[1], t, owner is not None)
                if off is not None:
                    return off
        if owner is not None:
            ol, oname, base = owner
            if oname == LAYER_INPUT or not self._dropped(ol, oname, True):
                self._hold(li, mb, key, t)
                return t
            self._handed_out(ol, mb, oname)
            return Handle(ol, mb, oname, -1, tuple(t.shape), tuple(t.stride()),
                          int(t.storage_offset() - base.storage_offset()))
        if not self._dropped(li, cur, False):
            self._hold(li, mb, key, t)
            return t
        return Handle(li, mb, cur, k)

    def unpack(self, h: Any) -> torch.Tensor:
        if self._reloaded is not None and isinstance(h, OffloadHandle):
            return self._reloaded(h)
        if not isinstance(h, Handle):
            held: torch.Tensor = h
            return held
        return self._restored(h)
