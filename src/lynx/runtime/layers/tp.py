"""Megatron-style tensor-parallel primitives on a torch.distributed process group.

Names follow Megatron-LM (`tensor_parallel/mappings.py`, `layers.py`): *copy* (forward identity, backward
all-reduce), *reduce* (forward all-reduce, backward identity), *gather* / *reduce-scatter* along the
sequence dimension (dim 0, layout [s, b, h]) for sequence parallelism.

Every collective is launched asynchronously and may carry a **window**: a callable run while the
collective is in flight, before it is waited for. That is where the recompute engine (`runtime.engine`)
places the recomputations a plan assigns to a communication op. The column-parallel linear follows
Megatron's backward: input gradient, launch its all-reduce (or reduce-scatter with SP), weight gradient,
window, wait. With ``group=None`` (TP = 1) no collective runs but the windows still open at the same points,
so a plan executes identically.

On CUDA the collective runs on a dedicated side stream (NCCL and gloo-on-CUDA both honour the current
stream), recomputation stays on the compute stream, and events order the two.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Window = Callable[[], None] | None

Group = dist.ProcessGroup | None
"""A tensor-parallel process group (None: TP 1, no collective)."""
_COMM_STREAMS: dict[int, Any] = {}
CollectiveTracer = Callable[[str, float, float, float], None]
_tracer: list[CollectiveTracer] = []


def set_collective_tracer(fn: CollectiveTracer | None) -> None:
    """Have every TP collective reported as fn(kind, launched, wait_started, done) (perf_counter seconds):
    [launched, wait_started) is its window, [wait_started, done) the exposed wait. None switches it off."""
    _tracer.clear()
    if fn is not None:
        _tracer.append(fn)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def call(module: torch.nn.Module, *args: Any) -> torch.Tensor:
    """`module(*args)` with its result typed (`Module.__call__` returns Any)."""
    out: torch.Tensor = module(*args)
    return out


def apply_fn(fn: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    """`fn.apply(*args)` with its result typed (torch declares `Function.apply` without types)."""
    out: torch.Tensor = fn.apply(*args)
    return out


def world(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank_in(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _comm_stream(device: torch.device) -> Any:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _COMM_STREAMS:
        _COMM_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _COMM_STREAMS[idx]


def run_collective(kind: str, x: torch.Tensor, group: Group, window: Window = None) -> torch.Tensor:
    """Run `kind` in {"allreduce", "allgather", "reducescatter"} on dim 0 of `x` asynchronously, call
    `window` while it is in flight, wait, return the result. TP = 1: the result is `x` (or a copy)."""
    n = world(group)
    t_launch = time.perf_counter()
    if n == 1:
        out = x.clone() if kind == "allreduce" else x
        if window is not None:
            window()
        return out
    x = x.contiguous()
    if kind == "allreduce":
        out = x.clone()
    elif kind == "allgather":
        out = x.new_empty((x.shape[0] * n, *x.shape[1:]))
    elif kind == "reducescatter":
        if x.shape[0] % n:
            raise ValueError(f"reduce-scatter: dim 0 ({x.shape[0]}) not divisible by TP={n}")
        out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    else:
        raise ValueError(kind)
    side = x.is_cuda
    if side:
        stream = _comm_stream(x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        ctx: Any = torch.cuda.stream(stream)
    else:
        import contextlib

        ctx = contextlib.nullcontext()
    with ctx:
        if kind == "allreduce":
            work = dist.all_reduce(out, group=group, async_op=True)
        elif kind == "allgather":
            work = _all_gather(out, x, group=group, async_op=True)
        elif x.is_cuda:
            work = dist.reduce_scatter_tensor(out, x, group=group, async_op=True)
        else:  # gloo has no reduce_scatter: all-reduce and keep our shard (same wire pattern as ring RS+AG)
            full = x.clone()
            work = dist.all_reduce(full, group=group, async_op=True)
    if window is not None:
        window()
    t_wait = time.perf_counter()
    work.wait()
    if _tracer:
        _tracer[0](kind, t_launch, t_wait, time.perf_counter())
    if side:  # the compute stream waits for the collective; the caching allocator learns who used what
        torch.cuda.current_stream(x.device).wait_stream(stream)
        out.record_stream(stream)
        x.record_stream(stream)
    if kind == "reducescatter" and not x.is_cuda:
        r = rank_in(group)
        out = full.narrow(0, r * out.shape[0], out.shape[0]).clone()
    return out


_DUAL = {"allreduce": None, "copy": "allreduce", "allgather": "reducescatter", "reducescatter": "allgather"}


class CommFn(torch.autograd.Function):
    """A TP mapping as one autograd node. `kind`: "allreduce" (g), "copy" (f), "allgather",
    "reducescatter". `fwd_window` runs inside the forward collective, `bwd_window` inside the backward one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kind: str, group: Group, fwd_window: Window,
                bwd_window: Window) -> torch.Tensor:
        ctx.kind, ctx.group, ctx.bwd_window = kind, group, bwd_window
        if kind == "copy":
            if fwd_window is not None:
                fwd_window()
            return x.view_as(x)
        return run_collective(kind, x, group, fwd_window)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        dual = _DUAL[ctx.kind]
        if dual is None:
            if ctx.bwd_window is not None:
                ctx.bwd_window()
            return g, None, None, None, None
        return run_collective(dual, g, ctx.group, ctx.bwd_window), None, None, None, None


class SplitSeqFn(torch.autograd.Function):
    """Enter the sequence-parallel region from a replicated tensor: keep this rank's slice of dim 0
    (backward: all-gather). With ``gather=True`` the reverse: leave it (forward all-gather, backward keep
    this rank's slice of a gradient that every rank holds in full, e.g. from a replicated LM head)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, gather: bool) -> torch.Tensor:
        ctx.group, ctx.gather = group, gather
        return run_collective("allgather", x, group) if gather else _own_slice(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return (_own_slice(g, ctx.group) if ctx.gather else run_collective("allgather", g, ctx.group)), None, None


def _own_slice(x: torch.Tensor, group: Group) -> torch.Tensor:
    n, r = world(group), rank_in(group)
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by TP={n}")
    # clone, not contiguous(): a dim-0 chunk is already contiguous, and a view would keep the whole
    # replicated tensor alive for as long as the shard is saved for backward
    return x.chunk(n, 0)[r].clone()


def reduce_from_tp(x: torch.Tensor, group: Group, fwd_window: Window = None) -> torch.Tensor:
    return apply_fn(CommFn, x, "allreduce", group, fwd_window, None)


def copy_to_tp(x: torch.Tensor, group: Group, bwd_window: Window = None) -> torch.Tensor:
    return apply_fn(CommFn, x, "copy", group, None, bwd_window)


def gather_from_sp(x: torch.Tensor, group: Group, fwd_window: Window = None, bwd_window: Window = None) -> torch.Tensor:
    return apply_fn(CommFn, x, "allgather", group, fwd_window, bwd_window)


def reduce_scatter_to_sp(x: torch.Tensor, group: Group, fwd_window: Window = None,
                         bwd_window: Window = None) -> torch.Tensor:
    return apply_fn(CommFn, x, "reducescatter", group, fwd_window, bwd_window)


class ColumnParallelLinearFn(torch.autograd.Function):
    """y = x W^T + b with W split by output rows, preceded by Megatron's *copy* (f). Backward: dgrad, launch
    its all-reduce, wgrad while it is in flight, then the window, then wait (Megatron's async grad
    all-reduce). Saves x and W only, so the saved-tensor accounting is exactly the GEMM's input.

    Under autocast the GEMM runs in the autocast dtype as `torch.nn.functional.linear` would (Megatron's
    `custom_fwd`): x, W and b are cast first and the casts are saved, so backward's GEMMs see one dtype; the
    gradients return in the parameters' dtype (fp32 master weights)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                group: Group, bwd_window: Window) -> torch.Tensor:
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            x, w, b = x.to(dt), w.to(dt), (b.to(dt) if b is not None else None)
        ctx.save_for_backward(x, w)
        ctx.has_bias, ctx.group, ctx.bwd_window = b is not None, group, bwd_window
        with torch.autocast(dev, enabled=False):
            return torch.nn.functional.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        gx = g.matmul(w)
        state: dict[str, torch.Tensor] = {}

        def wgrad_then_window() -> None:
            g2 = g.reshape(-1, g.shape[-1])
            state["gw"] = g2.t().matmul(x.reshape(-1, x.shape[-1]))
            if ctx.has_bias:
                state["gb"] = g2.sum(0)
            if ctx.bwd_window is not None:
                ctx.bwd_window()

        gx = run_collective("allreduce", gx, ctx.group, wgrad_then_window)
        return gx, state["gw"], state.get("gb"), None, None


def _init_weight(out_f: int, in_f: int, seed: int, std: float) -> torch.Tensor:
    """The full (unsplit) weight, drawn on CPU from its own generator: every TP degree sees the same model."""
    g = torch.Generator().manual_seed(seed)
    return torch.empty(out_f, in_f).normal_(0.0, std, generator=g)


class ColumnParallelLinear(torch.nn.Module):
    """Output features split over the group (QKV, FC1). Takes the full input, returns the local shard."""

    def __init__(self, in_f: int, out_f: int, group: Group = None, seed: int = 0, std: float = 0.02,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                 stride: int = 1) -> None:
        super().__init__()
        n, r = world(group), rank_in(group)
        if out_f % (n * stride):
            raise ValueError(f"column-parallel: {out_f} outputs not divisible by TP={n} x {stride}")
        self.group = group
        full = _init_weight(out_f, in_f, seed, std)
        # `stride` > 1 (QKV): each of the `stride` blocks is split separately, so a rank owns whole heads.
        shard = torch.cat([blk.chunk(n, 0)[r] for blk in full.chunk(stride, 0)], 0)
        self.weight = torch.nn.Parameter(shard.to(device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_f // n, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, bwd_window: Window = None) -> torch.Tensor:
        return apply_fn(ColumnParallelLinearFn, x, self.weight, self.bias, self.group, bwd_window)


class RowParallelLinear(torch.nn.Module):
    """Input features split over the group (attention projection, FC2). Returns the *partial* sum x W^T
    without bias: the all-reduce (or reduce-scatter) and the bias add are separate ops, as in Megatron's
    fused bias-dropout-add."""

    def __init__(self, in_f: int, out_f: int, group: Group = None, seed: int = 0, std: float = 0.02,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        n, r = world(group), rank_in(group)
        if in_f % n:
            raise ValueError(f"row-parallel: {in_f} inputs not divisible by TP={n}")
        full = _init_weight(out_f, in_f, seed, std)
        self.weight = torch.nn.Parameter(full.chunk(n, 1)[r].contiguous().to(device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_f, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def scaled_init_std(std: float, num_layers: int) -> float:
    """Megatron's output-layer init: std / sqrt(2 L)."""
    return std / math.sqrt(2.0 * max(1, num_layers))


def partial_over_tp(p: torch.nn.Parameter, sequence_parallel: bool) -> bool:
    """A weight replicated over TP whose gradient each TP rank computes in part: the norms of the sequence-parallel
    region (with SP), and the weights tagged `tp_partial` whatever SP (q/k norms; MLA's latent weights with SP)."""
    return (sequence_parallel and getattr(p, "sequence_parallel", False)) or getattr(p, "tp_partial", False)


def allreduce_sp_grads(module: torch.nn.Module, sequence_parallel: bool, group: Group) -> None:
    """Sum the partial gradients (`partial_over_tp`) over the TP group."""
    if world(group) == 1:
        return
    for p in module.parameters():
        if partial_over_tp(p, sequence_parallel) and p.grad is not None:
            dist.all_reduce(p.grad, group=group)
