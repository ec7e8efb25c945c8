"""Measure one `GPTLayer` op by op: forward, input-gradient and weight-gradient time, output bytes, and the
bytes autograd saves for backward (saved-tensor hooks). Runs inside one rank; needs torch.

How ops are separated (docs/profiling.md has the long form):

* The layer runs op by op through ``run_op`` (the op vocabulary is the grouping: bias adds, reshapes and
  transposes live inside the op that owns them, as the paper's profiler groups small operators).
* Forward: each op of a full forward pass is timed on its own (wall clock on CPU, CUDA events on GPU).
* Backward: in the timed forward each op reads detached copies of its inputs (leaves sharing storage), so
  every op has its own autograd graph; ``torch.autograd.grad`` from its output is timed w.r.t. those leaves
  (input gradient) and w.r.t. the op's parameters (weight gradient) separately, with ``retain_graph``.
  The parameters of an op are the AccumulateGrad leaves of its local autograd graph. An op whose
  backward is one custom autograd Function with a weight (the runtime's column-parallel linear, whose
  backward also launches the TP all-reduce) cannot be split that way: its input- and weight-gradient GEMMs
  are replayed on the op's real tensors instead.
* Comm ops: the forward is the op itself (the collective on the real group, after a barrier); the
  backward is the dual collective (`lynx.runtime.layers.tp.run_collective`) at the gradient's size.
* Restore overhead (CPU): the layer under the runtime's `RecomputeEngine` with every recomputation on demand,
  forward and backward, `repeats` times after one warm-up; each restoration as the engine times it. Its
  difference from the op's forward above is the engine's own time per restoration (`RuntimeCosts`).
* Saved bytes: one extra forward pass under ``saved_tensors_hooks``. Each saved tensor is matched by its
  storage to the op output it belongs to (parameters and buffers excluded); storages that belong to no op
  output (dropout masks, LayerNorm statistics) are side state of the op whose forward saved them.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lynx.graph import LAYER_INPUT
from lynx.runtime.layers.base import RuntimeLayer
from lynx.runtime.layers.tp import Group

COMM_PREFIXES = ("allreduce", "allgather", "reducescatter")
DUAL = {"allreduce": "allreduce", "allgather": "reducescatter", "reducescatter": "allgather"}


def comm_kind(name: str) -> str | None:
    """"attn_allreduce" -> "allreduce"; None for a compute op."""
    tail = name.rsplit("_", 1)[-1]
    return tail if tail in COMM_PREFIXES else None


def _preemptions() -> int:
    """Involuntary context switches of this process so far (all its threads): the OS took a core away."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


class Timer:
    """Wall clock on CPU; CUDA events (with a synchronize per measurement) on GPU.

    On CPU each measurement also notes whether the OS preempted the process meanwhile (`disturbed`): on a
    shared machine one lost time slice turns a 0.2 ms op into 10 ms, so such samples are set aside when
    enough clean ones exist (`robust_median_spread`)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.disturbed = False

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            self.disturbed = False
            return start.elapsed_time(end) / 1e3, out
        n0 = _preemptions()
        t0 = time.perf_counter()
        out = fn()
        t = time.perf_counter() - t0
        self.disturbed = _preemptions() != n0
        return t, out


@dataclass
class Samples:
    """Per op: lists of seconds over the timed repeats."""

    fwd: dict[str, list[float]] = field(default_factory=dict)
    dgrad: dict[str, list[float]] = field(default_factory=dict)
    wgrad: dict[str, list[float]] = field(default_factory=dict)
    disturbed: dict[str, list[bool]] = field(default_factory=dict)
    """Per key "fwd:op", "dgrad:op", "wgrad:op": whether each sample saw the process preempted."""
    split: dict[str, str] = field(default_factory=dict)
    """How each op's backward was split: "autograd", "replay" or "comm"."""


@dataclass
class SavedBytes:
    out_bytes: dict[str, float]
    side_bytes: dict[str, float]
    """Saved storages owned by no op output, by the op whose forward saved them (masks, statistics)."""
    saved_by: dict[str, tuple[str, ...]]
    """For each op, the op outputs (or "input") its backward reads, and itself if it saved side state."""
    saved_output_bytes: dict[str, float]
    """For each op output (and "input"): the storage bytes autograd holds for it (0 if no backward reads it)."""


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def count_saved(layer: Any, x: torch.Tensor, microbatch: int = 0) -> SavedBytes:
    """One forward pass under saved-tensor hooks: which storages autograd keeps for backward, per op."""
    excluded = {_storage(p)[0] for p in layer.parameters()} | {_storage(b)[0] for b in layer.buffers()}
    # a layer that runs another module's weights (lynx.integrations.torchtitan's TitanLayer) names them itself
    excluded |= {_storage(t)[0] for t in getattr(layer, "static_tensors", list)()}
    env: dict[str, torch.Tensor] = {LAYER_INPUT: x}
    owner: dict[int, str] = {_storage(x)[0]: LAYER_INPUT}
    packed: dict[str, list[torch.Tensor]] = {}
    for name in layer.op_names:
        rec: list[torch.Tensor] = []

        def pack(t: torch.Tensor, rec: list[torch.Tensor] = rec) -> torch.Tensor:
            rec.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            env[name] = layer.run_op(name, env, microbatch)
        packed[name] = rec
        owner.setdefault(_storage(env[name])[0], name)
    seen: set[int] = set()
    side = {n: 0.0 for n in layer.op_names}
    held = {n: 0.0 for n in (LAYER_INPUT, *layer.op_names)}
    saved_by: dict[str, tuple[str, ...]] = {}
    for name in layer.op_names:
        reads: list[str] = []
        for t in packed[name]:
            ptr, nbytes = _storage(t)
            if ptr in excluded or nbytes == 0:
                continue
            src = owner.get(ptr, name)
            if src not in reads:
                reads.append(src)
            if ptr in seen:
                continue
            seen.add(ptr)
            if ptr in owner:
                held[src] += nbytes
            else:
                side[name] += nbytes
        order = (LAYER_INPUT, *layer.op_names)
        saved_by[name] = tuple(sorted(reads, key=order.index))
    outs = {n: float(env[n].numel() * env[n].element_size()) for n in (LAYER_INPUT, *layer.op_names)}
    return SavedBytes(outs, side, saved_by, held)


def restore_times(layer: Any, x: torch.Tensor, policy: Any, repeats: int,
                  microbatch: int = 0) -> dict[str, list[float]]:
    """Per op: the seconds each restoration took inside a `RecomputeEngine` running `layer` under `policy`
    (a `LayerPolicy`, recomputations on demand), over `repeats` forward + backward passes after a warm-up."""
    from lynx.runtime.engine import RecomputeEngine

    engine = RecomputeEngine([layer], [policy], getattr(layer, "static_tensors", list)())
    out: dict[str, list[float]] = {}
    engine.tracer = lambda name, t0, t1: out.setdefault(name.split()[1], []).append(t1 - t0)
    try:
        for r in range(repeats + 1):
            if r == 1:
                out.clear()
            y = engine.forward(x.detach().requires_grad_(), microbatch)
            torch.autograd.backward(y, torch.ones_like(y))
            engine.end_step()
    finally:
        layer.window_hook = None
    return out


def restore_overhead(restore: dict[str, list[float]], fwd: dict[str, float], compute: set[str]) -> float:
    """The engine's own time per restoration: median over the compute ops of (median restore - forward), at
    least 0 (comm ops are left out: their restoration waits on the collective)."""
    diffs = sorted(statistics.median(v) - fwd[n] for n, v in restore.items() if v and n in compute and n in fwd)
    return max(0.0, statistics.median(diffs)) if diffs else 0.0


def op_params(layer: Any, out: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """The layer parameters in `out`'s autograd graph above its `inputs` (AccumulateGrad leaves)."""
    ids = {id(p): p for p in layer.parameters()}
    stop = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
    found: list[torch.nn.Parameter] = []
    stack, seen = [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen or id(fn) in stop:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)
        if var is not None and id(var) in ids and all(var is not f for f in found):
            found.append(ids[id(var)])
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return found


def _is_custom(out: torch.Tensor) -> bool:
    return isinstance(out.grad_fn, torch.autograd.function.BackwardCFunction)


def _replay_linear(timer: Timer, x: torch.Tensor, params: list[torch.nn.Parameter],
                   g: torch.Tensor) -> tuple[float, bool, float, bool] | None:
    """Input- and weight-gradient GEMMs of y = x W^T + b, on the op's own tensors."""
    ws = [p for p in params if p.dim() == 2]
    if len(ws) != 1:
        return None
    w = ws[0]
    bias = [p for p in params if p.dim() == 1 and p.shape[0] == w.shape[0]]
    if g.shape[-1] != w.shape[0] or x.shape[-1] != w.shape[1]:
        return None
    with torch.no_grad():
        d, _ = timer(lambda: g.matmul(w))
        d_bad = timer.disturbed
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        wt, _ = timer(lambda: (g2.t().matmul(x2), g2.sum(0) if bias else None))
    return d, d_bad, wt, timer.disturbed


class OpRunner:
    """Times every op of `layer` on `x`; call `repeat()` once per repeat."""

    def __init__(self, layer: RuntimeLayer, x: torch.Tensor, group: Group, microbatch: int = 0) -> None:
        self.layer, self.x, self.group, self.mb = layer, x, group, microbatch
        self.timer = Timer(x.device)
        self.names: tuple[str, ...] = tuple(layer.op_names)
        self.params: dict[str, list[torch.nn.Parameter]] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.samples = Samples()
        for n in self.names:
            self.samples.fwd[n], self.samples.dgrad[n], self.samples.wgrad[n] = [], [], []

    def _barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def forward(self) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]],
                               dict[str, tuple[float, bool]]]:
        """One forward pass, op by op. Each op reads detached copies of its inputs (same storage), so its
        autograd graph is its own and its backward can be timed alone."""
        env: dict[str, torch.Tensor] = {LAYER_INPUT: self.x.detach()}
        leaves: dict[str, list[torch.Tensor]] = {}
        times: dict[str, tuple[float, bool]] = {}
        for n in self.names:
            local = {d: env[d].detach().requires_grad_() for d in self.layer.op_inputs[n]}
            leaves[n] = list(local.values())
            if comm_kind(n):
                self._barrier()
            def op(n: str = n, local: dict[str, torch.Tensor] = local) -> torch.Tensor:
                return self.layer.run_op(n, {**env, **local}, self.mb)

            t, env[n] = self.timer(op)
            times[n] = (t, self.timer.disturbed)
        return env, leaves, times

    def backward_op(self, name: str, env: dict[str, torch.Tensor],
                    inputs: list[torch.Tensor]) -> tuple[float, bool, float, bool, str]:
        """Backward of one op on its own autograd graph from the timed forward (`inputs` are its leaves):
        (dgrad seconds, disturbed, wgrad seconds, disturbed, how it was split)."""
        from lynx.runtime.layers import tp

        kind = comm_kind(name)
        if kind is not None:
            g = self.grads.setdefault(name, torch.randn_like(env[name]))
            self._barrier()
            t, _ = self.timer(lambda: tp.run_collective(DUAL[kind], g, self.group))
            return t, self.timer.disturbed, 0.0, False, "comm"
        out = env[name]
        if name not in self.params:
            self.params[name] = op_params(self.layer, out, inputs)
        params = self.params[name]
        g = self.grads.setdefault(name, torch.randn_like(out))
        if params and _is_custom(out):
            res = _replay_linear(self.timer, inputs[0].detach(), params, g)
            if res is not None:
                return (*res, "replay")
        d, _ = self.timer(lambda: torch.autograd.grad(out, inputs, g, retain_graph=True, allow_unused=True))
        d_bad = self.timer.disturbed
        if not params or _is_custom(out):  # a custom backward computes everything at once
            return d, d_bad, 0.0, False, "autograd (unsplit)" if params else "autograd"
        w, _ = self.timer(lambda: torch.autograd.grad(out, params, g, retain_graph=True, allow_unused=True))
        return d, d_bad, w, self.timer.disturbed, "autograd"

    def repeat(self, record: bool) -> None:
        env, leaves, fwd = self.forward()
        bwd = {n: self.backward_op(n, env, leaves[n]) for n in reversed(self.names)}
        if not record:
            return
        s = self.samples
        for n in self.names:
            d, d_bad, w, w_bad, s.split[n] = bwd[n]
            for key, (t, bad) in (("fwd", fwd[n]), ("dgrad", (d, d_bad)), ("wgrad", (w, w_bad))):
                getattr(s, key)[n].append(t)
                s.disturbed.setdefault(f"{key}:{n}", []).append(bad)

    def stats(self, key: str, name: str) -> tuple[float, float]:
        """Median and spread of one quantity, over the undisturbed samples when there are at least 3."""
        xs = getattr(self.samples, key)[name]
        return robust_median_spread(xs, self.samples.disturbed.get(f"{key}:{name}", [False] * len(xs)))

    def disturbed_fraction(self) -> float:
        flags = [b for v in self.samples.disturbed.values() for b in v]
        return sum(flags) / len(flags) if flags else 0.0


MIN_CLEAN = 3


def robust_median_spread(xs: list[float], disturbed: list[bool]) -> tuple[float, float]:
    """`median_spread` of the samples the OS did not preempt, if at least `MIN_CLEAN` are left; else of all
    (long ops on a busy machine are rarely untouched, and one slice matters little to them)."""
    clean = [x for x, bad in zip(xs, disturbed, strict=True) if not bad]
    return median_spread(clean if len(clean) >= MIN_CLEAN else xs)


def median_spread(xs: list[float]) -> tuple[float, float]:
    """Median and half the 10th-90th percentile range (linear interpolation)."""
    if not xs:
        return 0.0, 0.0
    v = sorted(xs)

    def q(p: float) -> float:
        k = (len(v) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    return q(0.5), (q(0.9) - q(0.1)) / 2
