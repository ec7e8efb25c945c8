"""`lynx profile`: build the runtime's layer of the model's family for a shape and layout, measure it op by op
on one rank (rank 0 of the TP group), and turn the measurements into a `LayerGraph` plus per-op statistics.

The structure of the graph that is definition rather than measurement (op kind, block, which backward
collective overlaps which weight gradient, forward FLOPs) comes from the analytic graph of the same shape;
everything else (times, output bytes, side-state bytes, inputs, what each backward reads) is measured.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

import torch

import lynx
from lynx.cost.layer import build_layer_graph
from lynx.families.base import ACT_BYTES
from lynx.graph import LAYER_INPUT, GraphMeta, LayerGraph, Op, RuntimeCosts
from lynx.models import layer_params
from lynx.profile.calibrate import nominal_hardware
from lynx.profile.errors import ProfileError
from lynx.profile.measure import OpRunner, count_saved, restore_overhead, restore_times
from lynx.profile.store import OpStats, RunInfo
from lynx.runtime.layers.tp import Group
from lynx.spec import Hardware, ModelSpec, ParallelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SAVED_TOLERANCE = 0.02
"""Measured autograd-saved bytes must match the graph accounting to this relative error (per op)."""


@dataclass(frozen=True)
class ProfileConfig:
    model: str
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    micro_batch_size: int
    tp: int = 1
    sequence_parallel: bool = False
    dtype: str = "fp32"
    device: str = "cpu"
    dropout_p: float = 0.1
    warmup: int = 2
    repeats: int = 10
    seed: int = 1234
    threads: int = 0
    """CPU threads per rank; 0: the machine's cores divided by TP."""
    family: str = "gpt"
    """The model family (`lynx.families`): it picks the runtime layer that is measured."""
    num_query_groups: int = 0
    """K/V heads (grouped-query attention); 0: as many as attention heads."""

    def validate(self) -> None:
        h, a, f, t = self.hidden_size, self.num_attention_heads, self.ffn_hidden_size, self.tp
        for k in ("hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "micro_batch_size",
                  "tp", "repeats"):
            if getattr(self, k) <= 0:
                raise ProfileError(f"{k.replace('_', ' ')} must be positive, got {getattr(self, k)}")
        if self.warmup < 0:
            raise ProfileError(f"--warmup must be >= 0, got {self.warmup}")
        if h % a:
            raise ProfileError(f"hidden size {h} is not divisible by {a} attention heads")
        if a % t or f % t or (self.num_query_groups or a) % t:
            raise ProfileError(f"TP {t} must divide the {a} heads, the {self.num_query_groups or a} query groups "
                               f"and the FFN width {f}")
        if self.sequence_parallel and self.seq_length % t:
            raise ProfileError(f"sequence parallelism needs seq length {self.seq_length} divisible by TP {t}")
        if self.dtype not in DTYPES:
            raise ProfileError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if not 0.0 <= self.dropout_p < 1.0:
            raise ProfileError(f"dropout must lie in [0, 1), got {self.dropout_p}")

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    def model_spec(self) -> ModelSpec:
        """The planner's view of the profiled layer: the family's defaults plus this shape."""
        from lynx.errors import SpecError
        from lynx.families import get_family

        fields = {**get_family(self.family).defaults, "family": self.family, "name": self.model, "num_layers": 1,
                  "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
                  "num_query_groups": self.num_query_groups, "ffn_hidden_size": self.ffn_hidden_size,
                  "dropout": self.dropout_p > 0, "hidden_dropout": self.dropout_p,
                  "attention_dropout": self.dropout_p}
        if self.family == "torchtitan-llama3" and self.device == "cpu":
            fields["norm_fusion"] = False  # torchtitan's nn.RMSNorm: torch's fused kernel on CUDA, eager on CPU
        try:
            return ModelSpec(**fields)
        except SpecError as e:
            raise ProfileError(str(e)) from None

    def parallel_spec(self) -> ParallelSpec:
        return ParallelSpec(tp=self.tp, sequence_parallel=self.sequence_parallel,
                            micro_batch_size=self.micro_batch_size, global_batch_size=self.micro_batch_size,
                            seq_length=self.seq_length)


# -- the analytic reference at the profiled dtype ------------------------------------------------------
def analytic_graph(cfg: ProfileConfig, hw: Hardware | None = None) -> LayerGraph:
    """The cost model's graph of the profiled shape, with activation bytes at the profiled dtype."""
    hw = hw or nominal_hardware("reference", 1e12, 1e11)
    g = build_layer_graph(cfg.model_spec(), hw, cfg.parallel_spec())
    k = cfg.elem_bytes / ACT_BYTES
    ops = tuple(replace(o, out_bytes=o.out_bytes * k) for o in g.ops)
    return replace(g, ops=ops, input_bytes=g.input_bytes * k, meta=replace(g.meta, dtype=cfg.dtype))


def expected_saved(g: LayerGraph) -> dict[str, float]:
    """Bytes autograd should hold per op output (and "input"): the output if some backward reads it, plus
    the op's side state (mask)."""
    needed = {s for o in g.ops for s in o.saved}
    out = {LAYER_INPUT: g.input_bytes if LAYER_INPUT in needed else 0.0}
    for o in g.ops:
        out[o.name] = (o.out_bytes if o.name in needed and o.name != g.output_op else 0.0) + o.mask_bytes
    return out


# -- memory check --------------------------------------------------------------------------------------
def available_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def needed_bytes(cfg: ProfileConfig) -> float:
    """Per rank: parameters and their gradients, two forward passes' activations, and gradient buffers."""
    m = cfg.model_spec()
    g = analytic_graph(cfg)
    params = layer_params(m) / cfg.tp * cfg.elem_bytes
    acts = g.full_activation_bytes() + sum(o.out_bytes for o in g.ops)
    return 2 * params + 3 * acts


def check_memory(cfg: ProfileConfig, device: torch.device) -> None:
    need, have = needed_bytes(cfg), available_bytes(device)
    ranks_here = cfg.tp if device.type == "cpu" else 1
    if need * ranks_here > 0.9 * have:
        raise ProfileError(
            f"this layer does not fit: profiling needs about {need * ranks_here / 2**30:.1f} GiB "
            f"({ranks_here} rank(s) x {need / 2**30:.1f} GiB) but {device.type} has {have / 2**30:.1f} GiB free; "
            "lower --micro-batch or --seq-len, or raise --tp")


# -- device facts --------------------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu: {name}"


def measure_peaks(device: torch.device, dtype: torch.dtype, timer: Callable[[Callable[[], Any]], Any]) -> \
        tuple[float, float]:
    """Best-of-3 GEMM FLOP/s (n = 1024) and copy bandwidth (64 MiB), the nominal peaks of a CPU."""
    n = 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    src = torch.empty(16 << 20, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    src.fill_(1.0)
    mm = min(timer(lambda: a @ b)[0] for _ in range(4))
    cp = min(timer(lambda: dst.copy_(src))[0] for _ in range(4))
    return 2.0 * n ** 3 / mm, 2.0 * src.numel() * 4 / cp


# -- one rank ------------------------------------------------------------------------------------------
def run_rank(cfg: ProfileConfig, group: Group, device: torch.device,
             progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Build the layer, count saved bytes, time all ops; returns plain data (picklable across processes)."""
    from lynx.runtime.layers.family import runtime_for

    torch.manual_seed(cfg.seed)
    spec = cfg.model_spec()
    rt = runtime_for(spec)  # the family picks the runtime layer
    try:
        lcfg = rt.config(spec, cfg.parallel_spec(), DTYPES[cfg.dtype], False)
    except ValueError as e:
        raise ProfileError(str(e)) from None
    try:
        layer = rt.layer(lcfg, group, device=device, seed=cfg.seed)
        s_local = cfg.seq_length // cfg.tp if cfg.sequence_parallel else cfg.seq_length
        x = torch.randn(s_local, cfg.micro_batch_size, cfg.hidden_size, device=device, dtype=DTYPES[cfg.dtype])
        saved = count_saved(layer, x.detach().requires_grad_())
        runner = OpRunner(layer, x, group)
        total = cfg.warmup + cfg.repeats
        for r in range(total):
            runner.repeat(record=r >= cfg.warmup)
            if progress is not None:
                progress(r + 1, total)
        restore: dict[str, list[float]] = {}
        if device.type == "cpu":  # on a GPU the engine's Python runs ahead of the kernels: not measured
            from lynx.policy.rules import full_layer

            restore = restore_times(layer, x, full_layer(analytic_graph(cfg)), cfg.repeats)
        peaks = measure_peaks(device, DTYPES[cfg.dtype], runner.timer)
    except torch.OutOfMemoryError:
        raise ProfileError("out of device memory while profiling; lower --micro-batch or --seq-len") from None
    return {"op_names": list(layer.op_names), "op_inputs": {k: list(v) for k, v in layer.op_inputs.items()},
            "stats": {n: {k: runner.stats(k, n) for k in ("fwd", "dgrad", "wgrad")} for n in layer.op_names},
            "split": dict(runner.samples.split), "disturbed_fraction": runner.disturbed_fraction(),
            "saved": saved, "peaks": peaks, "restore": restore, "device": device_name(device),
            "threads": torch.get_num_threads()}


# -- assembling the result -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ProfileResult:
    graph: LayerGraph
    ops: tuple[OpStats, ...]
    info: RunInfo
    extra: dict[str, Any]


def assemble(cfg: ProfileConfig, raw: dict[str, Any], wall_s: float) -> ProfileResult:
    ref = analytic_graph(cfg)
    names = tuple(raw["op_names"])
    if names != ref.names:
        raise ProfileError(f"the runtime layer's ops {names} differ from the graph vocabulary {ref.names}")
    st, sv = raw["stats"], raw["saved"]
    expect = expected_saved(ref)
    ops: list[Op] = []
    stats: list[OpStats] = []
    for o in ref.ops:
        n = o.name
        (f, fs), (d, ds), (w, ws) = st[n]["fwd"], st[n]["dgrad"], st[n]["wgrad"]
        side = sv.side_bytes[n]
        held = sv.saved_output_bytes[n] if n != ref.output_op else 0.0
        ops.append(replace(o, fwd_time=f, bwd_time=d + w, wgrad_time=w if not o.is_comm else 0.0,
                           out_bytes=sv.out_bytes[n], mask_bytes=side, inputs=tuple(raw["op_inputs"][n]),
                           saved=sv.saved_by[n]))
        stats.append(OpStats(n, f, fs, d, ds, w, ws, held + side, expect[n]))
    peak_flops, mem_bw = raw["peaks"]
    meta = GraphMeta(source="profile", model=cfg.model, hidden_size=cfg.hidden_size,
                     num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
                     seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size, tp=cfg.tp,
                     sequence_parallel=cfg.sequence_parallel, device=raw["device"], dtype=cfg.dtype,
                     family=cfg.family, num_query_groups=cfg.model_spec().num_query_groups)
    restore = raw.get("restore") or {}
    runtime = None
    if restore:  # measured on a CPU: the runtime's costs beyond the ops (docs/runtime-overhead.md)
        fwd = {o.name: o.fwd_time for o in ops}
        runtime = RuntimeCosts(restore_overhead(restore, fwd, {o.name for o in ops if not o.is_comm}),
                               gemm_flops=peak_flops, memory_bw_Bps=mem_bw)
    graph = LayerGraph(tuple(ops), input_bytes=sv.out_bytes.get(LAYER_INPUT, ref.input_bytes), meta=meta,
                       runtime=runtime)
    # the layer: sums of the op medians and (conservatively) of their spreads
    lf, lfs = sum(s.fwd_s for s in stats), sum(s.fwd_spread_s for s in stats)
    lb = sum(s.dgrad_s + s.wgrad_s for s in stats)
    lbs = sum(s.dgrad_spread_s + s.wgrad_spread_s for s in stats)
    extra = {
        "layer_fwd_s": lf, "layer_fwd_spread_s": lfs, "layer_bwd_s": lb, "layer_bwd_spread_s": lbs,
        "input_saved_bytes": sv.saved_output_bytes[LAYER_INPUT], "input_expected_bytes": expect[LAYER_INPUT],
        "saved_mismatch": saved_mismatches(stats), "split": raw["split"],
        "disturbed_fraction": raw["disturbed_fraction"],
        "device_peak_flops": peak_flops, "device_mem_bw_Bps": mem_bw, "dropout_p": cfg.dropout_p,
        "seed": cfg.seed,
        "restore_s": {n: float(statistics.median(v)) for n, v in restore.items() if v},
        "restore_op_s": runtime.restore_op_s if runtime is not None else None,
    }
    info = RunInfo(model=cfg.model, dtype=cfg.dtype, device=raw["device"], torch_version=torch.__version__,
                   lynx_version=lynx.__version__, python_version=platform.python_version(),
                   host=platform.node(), warmup=cfg.warmup, repeats=cfg.repeats, threads=raw["threads"],
                   wall_s=wall_s, created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return ProfileResult(graph, tuple(stats), info, extra)


def saved_mismatches(stats: list[OpStats] | tuple[OpStats, ...], tol: float = SAVED_TOLERANCE) -> list[str]:
    """Ops whose measured saved bytes differ from the accounting by more than `tol` (relative)."""
    bad = []
    for s in stats:
        ref = max(s.expected_saved_bytes, 1.0)
        if abs(s.saved_bytes - s.expected_saved_bytes) > tol * ref:
            bad.append(s.name)
    return bad


def prepare(cfg: ProfileConfig) -> torch.device:
    """Everything that can refuse a profile before any process starts: shape, device, memory."""
    from lynx.profile.launch import resolve_device

    cfg.validate()
    device = resolve_device(cfg.device, cfg.tp)
    check_memory(cfg, device)
    return device


def profile(cfg: ProfileConfig, progress: Callable[[int, int], None] | None = None,
            rendezvous: str | None = None, timeout_s: float = 60.0) -> ProfileResult:
    """Profile one layer: in this process for TP 1, in TP local processes (gloo / NCCL) otherwise."""
    from lynx.profile.launch import run_distributed

    device = prepare(cfg)
    t0 = time.perf_counter()
    if cfg.tp == 1 and rendezvous is None:
        threads = torch.get_num_threads()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        try:
            raw = run_rank(cfg, None, device, progress)
        finally:
            torch.set_num_threads(threads)
    else:
        raw = run_distributed(run_rank, cfg, device, progress, rendezvous, timeout_s)
    return assemble(cfg, raw, time.perf_counter() - t0)

