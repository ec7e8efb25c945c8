"""What torchtitan's Llama 3 block keeps for backward, per lynx op (the bytes `lynx.families.titan` prices).

`saved_bytes_by_op` runs one block's forward under ``saved_tensors_hooks`` and a dispatch mode: every tensor an
aten op produces is tagged with the innermost submodule running and the op, every storage autograd saves is
counted once, and each is charged to the lynx op whose module produced it. Parameters and buffers (RoPE's
table) are not activations and are left out; the block's own input is reported under ``"input"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lynx.integrations.torchtitan._fence import LOOSE_OPS, MODULE_OPS, dispatch_mode_base


class _Tagger(dispatch_mode_base()):  # type: ignore[misc]
    def __init__(self, where: Callable[[], str]) -> None:
        super().__init__()
        self.where = where
        self.tag: dict[int, str] = {}
        self.alive: list[torch.Tensor] = []  # keep every output alive so no storage address is reused
        self.calls: dict[tuple[str, str], int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        mod = self.where()
        name = func.overloadpacket.__name__
        k = self.calls.get((mod, name), 0)
        self.calls[(mod, name)] = k + 1
        op = LOOSE_OPS.get((mod, name, k)) or MODULE_OPS.get(mod) or f"{mod or 'block'}:{name}"
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.alive.append(o)
                self.tag.setdefault(o.untyped_storage().data_ptr(), op)
        return out


def saved_bytes_by_op(block: nn.Module, *inputs: Any) -> dict[str, int]:
    """Bytes one forward of `block` keeps for backward, by lynx op (each storage once)."""
    stack: list[str] = []
    handles = []

    def enter(fqn: str) -> Callable[..., None]:
        return lambda *_: stack.append(fqn)

    def leave(*_: Any) -> None:
        stack.pop()

    for fqn, sub in block.named_modules():
        if fqn:
            handles += [sub.register_forward_pre_hook(enter(fqn)), sub.register_forward_hook(leave)]
    tagger = _Tagger(lambda: stack[-1] if stack else "")
    for t in inputs:
        if isinstance(t, torch.Tensor):
            tagger.tag[t.untyped_storage().data_ptr()] = "input"
    static = {p.untyped_storage().data_ptr() for p in block.parameters()}
    static |= {b.untyped_storage().data_ptr() for b in block.buffers()}
    saved: dict[int, tuple[int, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in static:
            saved.setdefault(st.data_ptr(), (st.nbytes(), tagger.tag.get(st.data_ptr(), "?")))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tagger:
            block(*inputs)
    finally:
        for h in handles:
            h.remove()
    out: dict[str, int] = {}
    for nbytes, op in saved.values():
        out[op] = out.get(op, 0) + nbytes
    return out
