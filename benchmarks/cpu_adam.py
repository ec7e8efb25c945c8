"""The host's Adam step as Megatron-Core's optimizer CPU offload runs it (`lynx.cost.optimizer_offload`): torch's
fused AdamW on fp32 CPU tensors, on one thread (torchrun's OMP_NUM_THREADS=1 for every rank of a multi-rank node),
in elements per second. `HostLink.cpu_adam_elements_per_s`'s default is this figure from this project's CI machine;
a user's own host prints its own (put it in the hardware file's ``host_link``).

Besides it, for scale: the same step with 2 threads, torch's per-tensor (non-fused, non-foreach) AdamW, and the
bytes a fused step moves at 28 B per element (parameter, gradient, both moments read; parameter and moments
written) against a streaming triad on the same tensors.

Run: PYTHONPATH=src python benchmarks/cpu_adam.py [--elements N] [--results benchmarks/results/cpu_adam.json]
"""

from __future__ import annotations

import argparse
import time

import _results
import torch
from rich.console import Console
from rich.table import Table

from lynx.spec import PCIE_GEN5_X16

ADAM_BYTES = 28
"""HBM-style count of what one fused AdamW element moves: p, g, m, v read (16), p, m, v written (12)."""
TOLERANCE = 0.5
"""The default must be within a factor of 2 of this machine's figure (it is this machine's figure, rounded)."""


def _adam_rate(n: int, threads: int, fused: bool, repeats: int) -> float:
    torch.set_num_threads(threads)
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True) if fused else torch.optim.AdamW([p], lr=1e-3, foreach=False)
    opt.step()  # the moments are allocated on the first step
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t)
    return n / best


def _triad_Bps(n: int, repeats: int) -> float:
    torch.set_num_threads(1)
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    torch.add(a, b, alpha=2.0, out=c)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.add(a, b, alpha=2.0, out=c)
        best = min(best, time.perf_counter() - t)
    return 12 * n / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=50_000_000, help="fp32 elements per tensor (default 5e7)")
    ap.add_argument("--repeats", type=int, default=5)
    _results.add_option(ap, "cpu_adam")
    args = ap.parse_args()
    run = _results.Run()
    n, r = args.elements, args.repeats
    one = _adam_rate(n, 1, True, r)
    two = _adam_rate(n, 2, True, r)
    plain = _adam_rate(n, 1, False, r)
    triad = _triad_Bps(n, r)
    default = PCIE_GEN5_X16.cpu_adam_elements_per_s
    holds = abs(default / one - 1.0) <= TOLERANCE
    t = Table(title=f"torch {torch.__version__} AdamW on {n:,} fp32 elements (best of {r})")
    for c in ("step", "threads", "elements/s", "GB/s at 28 B", "target", "holds"):
        t.add_column(c, justify="right" if c not in ("step", "target") else "left")
    t.add_row("fused (Megatron's CPUAdam)", "1", f"{one:.3g}", f"{one * ADAM_BYTES / 1e9:.1f}",
              f"lynx's default {default:.3g} within x{1 + TOLERANCE:g}", "yes" if holds else "NO")
    t.add_row("fused", "2", f"{two:.3g}", f"{two * ADAM_BYTES / 1e9:.1f}", "", "")
    t.add_row("per tensor (foreach=False)", "1", f"{plain:.3g}", f"{plain * ADAM_BYTES / 1e9:.1f}", "", "")
    t.add_row("triad c = a + 2b (12 B)", "1", "", f"{triad / 1e9:.1f}", "", "")
    Console().print(t)
    figs = [
        _results.Figure("fused AdamW, 1 thread (the rate lynx prices per rank)", round(one / 1e9, 3), "G elements/s",
                        f"lynx's default {default / 1e9:.2f} within x{1 + TOLERANCE:g}", holds),
        _results.Figure("fused AdamW, 2 threads", round(two / 1e9, 3), "G elements/s"),
        _results.Figure("AdamW per tensor, 1 thread", round(plain / 1e9, 3), "G elements/s"),
        _results.Figure("fused AdamW, 1 thread, at 28 B per element", round(one * ADAM_BYTES / 1e9, 1), "GB/s"),
        _results.Figure("triad, 1 thread", round(triad / 1e9, 1), "GB/s"),
    ]
    run.write(args.results, "cpu_adam", "measurement",
              "The host's Adam step (Megatron-Core's optimizer CPU offload): torch's fused AdamW on the CPU", figs,
              notes=("one process on a 2-core machine: a node's ranks each run one such thread and share its memory "
                     "bandwidth, which this does not measure",))


if __name__ == "__main__":
    main()
