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


GEMM_OPS = frozenset({"mm", "addmm", "bmm", "matmul", "linear"})
"""Compute-bound aten ops `eager_traffic` leaves out (lynx prices GEMMs by FLOPs and shape, not traffic)."""


class _Traffic(dispatch_mode_base()):  # type: ignore[misc]
    """Bytes read plus written by every memory-bound aten op (tensor arguments and results at their logical
    size), and the count of such ops (kernels). Views (every result aliasing an input, not in place) move nothing;
    GEMMs and attention kernels are left out."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.kernels = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in GEMM_OPS or "attention" in name:
            return out
        ins = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        for a in args:
            if isinstance(a, (list, tuple)):
                ins += [t for t in a if isinstance(t, torch.Tensor)]
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        held = {t.untyped_storage().data_ptr() for t in ins}
        if outs and not name.endswith("_") and all(o.untyped_storage().data_ptr() in held for o in outs):
            return out  # a view
        self.nbytes += sum(t.numel() * t.element_size() for t in (*ins, *outs))
        self.kernels += 1
        return out


def eager_traffic(fn: Callable[[], torch.Tensor], grad: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
    """((forward bytes, kernels), (backward bytes, kernels)) of the memory-bound aten ops `fn()` runs and then its
    backward from `grad` runs: what lynx's eager prices count (`lynx.families.fusion`, `families.titan`)."""
    fwd, bwd = _Traffic(), _Traffic()
    with fwd:
        y = fn()
    with bwd:
        y.backward(grad)
    return (fwd.nbytes, fwd.kernels), (bwd.nbytes, bwd.kernels)
