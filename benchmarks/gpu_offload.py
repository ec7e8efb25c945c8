"""Activation offloading on a GPU against the planner's assumptions (issue 22 item 6; needs CUDA, skips without).

    python benchmarks/gpu_offload.py [--out FILE.json] [--reps 5] [--markdown]

Three measurements, each printed beside its target:

1. **Copy bandwidth.** Device-to-host and host-to-device copies into / out of pinned host buffers, one per
   tensor one Llama-3-70B layer offloads at TP 8 (the sizes come from the `lynx-offload` plan of Llama-3-70B on
   64 H100s, TP 8 x PP 8, sequence 32768, micro-batch 1: stage 0's first layer; the planner's own graph bytes).
   Target: at least the per-GPU share of the preset's host link (`h100-80g-nvlink`: `policy.offload.offload_link`,
   PCIe Gen5 x16 per two GPUs, lynx.spec `default_host_link`), which is what the planner prices copies at.
2. **Overlap.** The same copies out, then back, on a side stream while the compute stream runs bf16 GEMMs (one
   8192 x 8192 x 8192 matmul after another, about as long as the copies at the preset's bandwidth). Exposed copy
   time = (GEMMs with copies) - (GEMMs alone). The planner's model: a copy hides behind compute that runs while
   it is in flight, at the link's bandwidth, so predicted exposed = max(0, copy time at the preset's share - GEMM
   time). Target: measured exposed <= predicted + 10% of the copy time.
3. **Peak.** A 4-layer GPT stack in bf16 (hidden 2048, sequence 2048, micro-batch 4) through the recompute engine
   with its heavy ops offloaded, two micro-batches in flight (F0 F1 B0 B1, a first pipeline stage's order):
   `torch.cuda.max_memory_allocated` less what was allocated before and less the parameters' gradients,
   against the planner's predicted peak for that policy (`runtime.predict.predicted_activation_bytes`) plus its
   gradient workspace (`lynx.cost.memory.grad_workspace_bytes`, as benchmarks/gpu_memory.py). Target: peak <= planned.

Without CUDA it prints one line and exits 0 (benchmarks/gpu_session.sh runs it on a lent GPU). `table_rows` (the
targets) and `layer_offload_sizes` (the planner's sizes) run anywhere; tests/unit/test_gpu_offload_bench.py
checks them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import _results
from _targets import Targets

MIB = 2**20
OVERLAP_SLACK = 0.10
"""Exposed copy time may exceed the prediction by this share of the copy time (event timing, stream start-up)."""


def layer_offload_sizes() -> tuple[list[tuple[str, int]], float, float]:
    """(op, bytes) of what one Llama-3-70B TP 8 layer offloads in the `lynx-offload` plan (64 H100s, TP 8, PP 8,
    sequence 32768, micro-batch 1: stage 0, layer 0), and the per-GPU (d2h, h2d) bandwidth of the preset's host
    link (bytes/s) the planner prices them at."""
    import warnings

    from lynx.api import make_problem
    from lynx.methods import get_method
    from lynx.models import load_model
    from lynx.policy.offload import offload_link
    from lynx.problem import PlanOptions
    from lynx.spec import ParallelSpec, load_hardware

    hw = load_hardware("h100-80g-nvlink")
    par = ParallelSpec(tp=8, pp=8, micro_batch_size=1, global_batch_size=64, seq_length=32768)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prob = make_problem(load_model("llama3-70b"), hw, par, PlanOptions())
    res = get_method("lynx-offload").fn(prob)
    lp = res.policies[0].layers[0]
    sizes = [(n, int(prob.graph.keep_bytes(n))) for n in sorted(lp.offload) if prob.graph.keep_bytes(n) > 0]
    link = offload_link(hw)
    assert link is not None  # the preset has a host link (lynx.spec.default_host_link)
    return sizes, link.d2h_Bps, link.h2d_Bps


def table_rows(m: dict[str, Any], targets: Targets) -> list[tuple[str, str, str, str]]:
    """(figure, measured, target, holds) rows from the measurements `m` (keys below; a missing one is "n/a")."""
    rows: list[tuple[str, str, str, str]] = []
    for way, pred in (("d2h", m["link_d2h_Bps"]), ("h2d", m["link_h2d_Bps"])):
        got = m.get(f"{way}_Bps")
        rows.append((f"{way} bandwidth, pinned, GB/s", "n/a" if got is None else f"{got / 1e9:.1f}",
                     f">= {pred / 1e9:.1f} (preset's per-GPU share)",
                     targets.at_least(f"{way} bandwidth at least the preset's", got, pred)))
    exposed, pred_exposed, copy_s = m.get("exposed_s"), m.get("predicted_exposed_s"), m.get("copy_s")
    bound = None if pred_exposed is None or copy_s is None else pred_exposed + OVERLAP_SLACK * copy_s
    rows.append(("exposed copy time beside GEMMs, ms", "n/a" if exposed is None else f"{exposed * 1e3:.2f}",
                 "n/a" if bound is None else f"<= {bound * 1e3:.2f} (predicted {pred_exposed * 1e3:.2f} + 10% copy)",
                 targets.add("exposed copy time within the prediction",
                             None if exposed is None or bound is None else exposed <= bound)))
    peak, planned = m.get("peak_bytes"), m.get("planned_peak_bytes")
    rows.append(("offloading engine's allocator peak, MiB", "n/a" if peak is None else f"{peak / MIB:.1f}",
                 "n/a" if planned is None else f"<= {planned / MIB:.1f} (planned)",
                 targets.add("allocator peak at most the planned peak",
                             None if peak is None or planned is None else peak <= planned)))
    return rows


def _time(fn: Any, reps: int) -> float:
    """Median seconds of `fn()` on the current stream, by CUDA events."""
    import torch

    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return sorted(out)[len(out) // 2]


def measure_copies(sizes: list[tuple[str, int]], reps: int, link_d2h: float, link_h2d: float) -> dict[str, Any]:
    import torch

    dev = torch.device("cuda")
    devs = [torch.empty(n, dtype=torch.uint8, device=dev) for _, n in sizes]
    hosts = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _, n in sizes]
    total = sum(n for _, n in sizes)
    side = torch.cuda.Stream()

    def out() -> None:
        for h, d in zip(hosts, devs, strict=True):
            h.copy_(d, non_blocking=True)

    def back() -> None:
        for h, d in zip(hosts, devs, strict=True):
            d.copy_(h, non_blocking=True)

    out()
    back()
    torch.cuda.synchronize()
    t_out, t_back = _time(out, reps), _time(back, reps)
    # GEMMs about as long as the copies at the preset's bandwidth
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    one = _time(lambda: a @ b, reps)
    predicted_copy = total / link_d2h + total / link_h2d
    n_gemm = max(1, round(predicted_copy / max(one, 1e-6)))

    def gemms() -> None:
        for _ in range(n_gemm):
            torch.mm(a, b)

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out()
            back()
        gemms()
        torch.cuda.current_stream().wait_stream(side)

    t_gemm = _time(gemms, reps)
    t_both = _time(both, reps)
    return {"sizes": sizes, "total_bytes": total, "d2h_Bps": total / t_out, "h2d_Bps": total / t_back,
            "copy_s": t_out + t_back, "gemm_s": t_gemm, "gemms": n_gemm, "both_s": t_both,
            "exposed_s": max(0.0, t_both - t_gemm), "predicted_copy_s": predicted_copy,
            "predicted_exposed_s": max(0.0, predicted_copy - t_gemm)}


def measure_peak(layers: int = 4, hidden: int = 2048, seq: int = 2048, mb: int = 4,
                 device: str = "cuda") -> dict[str, Any]:
    """The offloading engine's allocator peak against the planner's (see the module docstring, 3). On the CPU
    (tests: small sizes) no allocator figure ("peak_bytes" None), the rest the same."""
    import torch
    from _harness import problem_for

    from lynx.cost.memory import grad_workspace_bytes
    from lynx.decisions import LayerPolicy, RecomputePolicy
    from lynx.runtime.engine import RecomputeEngine
    from lynx.runtime.layers.gpt import GPTLayer, LayerConfig
    from lynx.runtime.predict import predicted_activation_bytes, predicted_offloaded_bytes, runtime_graph

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = LayerConfig(hidden_size=hidden, num_attention_heads=16, ffn_hidden_size=4 * hidden, seq_length=seq,
                      micro_batch_size=mb, dtype=dtype, num_layers=layers)
    stack = torch.nn.ModuleList(GPTLayer(cfg, None, layer_index=i, device=dev) for i in range(layers))
    graph = runtime_graph(problem_for(cfg, layers, 32000, 2, hardware="h100-80g-nvlink").graph, dtype)
    heavy = frozenset({"qkv", "softmax", "attn_dropout", "fc1", "gelu"}) & set(graph.names)
    lp = LayerPolicy(keep=graph.needed(), offload=heavy)
    pol = RecomputePolicy("offload-heavy", (lp,) * layers)
    eng = RecomputeEngine(list(stack), pol)
    grad_bytes = sum(p.numel() * p.element_size() for p in stack.parameters())
    peaks: list[int | None] = []
    for _ in range(2):  # the first pass warms the allocator; the second is reported
        for p in stack.parameters():
            p.grad = None
        eng.stats.reset()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        xs = [torch.randn(seq, mb, hidden, device=dev, dtype=dtype, requires_grad=True) for _ in range(2)]
        ys = [eng.forward(x, j) for j, x in enumerate(xs)]
        for y in ys:
            y.backward(torch.ones_like(y))
        eng.end_step()
        if cuda:
            torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before - grad_bytes if cuda else None)
        del xs, ys
    _, pred_peak = predicted_activation_bytes(graph, pol, cfg, in_flight=2)
    return {"peak_bytes": peaks[-1], "predicted_peak_bytes": pred_peak,
            "planned_peak_bytes": pred_peak + grad_workspace_bytes(graph), "engine_peak_bytes": eng.stats.peak_bytes,
            "offloaded_bytes_per_microbatch": eng.stats.offloaded_bytes / 2,
            "predicted_offloaded_bytes_per_microbatch": predicted_offloaded_bytes(graph, pol, cfg)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--markdown", action="store_true")
    _results.add_option(ap, "gpu_offload")
    a = ap.parse_args(argv)
    run = _results.Run()
    if a.reps < 1:
        ap.error("--reps: must be at least 1")
    if a.out is not None and not a.out.resolve().parent.is_dir():
        ap.error(f"--out {a.out}: directory {a.out.resolve().parent} does not exist")
    import torch

    if not torch.cuda.is_available():
        print("gpu_offload: skipped, no CUDA device (run it on a GPU: benchmarks/gpu_session.sh offload)")
        return 0
    from _markdown import Out
    from rich.table import Table

    sizes, d2h, h2d = layer_offload_sizes()
    m: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                         "link_d2h_Bps": d2h, "link_h2d_Bps": h2d}
    m.update(measure_copies(sizes, a.reps, d2h, h2d))
    m.update(measure_peak())
    targets = Targets()
    t = Table(title=f"Offloading on {m['device']}: one Llama-3-70B TP 8 layer's offloaded tensors "
                    f"({', '.join(f'{n} {b / MIB:.0f} MiB' for n, b in sizes)})")
    for c in ("figure", "measured", "target", "holds"):
        t.add_column(c, justify="right")
    for row in table_rows(m, targets):
        t.add_row(*row)
    con = Out(a.markdown)
    con.print(t)
    con.print(targets.summary())
    if a.out:
        a.out.write_text(json.dumps(m, indent=2))
    run.write(a.results, "gpu_offload", "measurement", "Offload copies on a GPU: bandwidth, exposed copy time, "
              "allocator peak", _results.figures_of(targets), targets.summary())
    return 0


__all__ = ["layer_offload_sizes", "main", "table_rows"]

if __name__ == "__main__":
    sys.exit(main())
