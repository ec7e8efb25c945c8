"""Would Megatron-Core's optimizer CPU offload lift lynx's pick on Mist's L4 workloads? (issue 35: the search does not
choose optimizer offloading, which Mist uses, up to 87.5% of a stage's optimizer state on gpt 7b.)

For the L4 cases with measured figures where Mist offloads optimizer state (the 7B models, `CASES`; the 1.3B and
2.7B ones fit without recomputation in Mist's choice, and their searches take minutes each), lynx's search (`lynx
plan --gpus N`, as benchmarks/mist.py's "pick": top 10, Megatron's gradient overlap, the preset's budget) runs once
on Megatron-LM's fp16 recipe (the "pick" of benchmarks/mist.py, which cannot offload: Megatron-Core's
`--optimizer-cpu-offload` needs `--use-precision-aware-optimizer`, priced under `--bf16` only, decision 0250), then
on the bf16 recipe with that offload at each fraction of `FRACTIONS` (`--optimizer-offload-fraction`,
`--overlap-cpu-optimizer-d2h-h2d`) and without it. Every search prices every candidate with the same offload setting
(a flag the user gives holds for every candidate). The table prints each search's pick and its time beside Mist's
measured time; no target: the figures say whether the missing dimension is what keeps the pick near Mist
(docs/mist.md, "What stops each target").

Run: PYTHONPATH=src python benchmarks/mist_optimizer_offload.py
         [--results benchmarks/results/mist_optimizer_offload.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import _results
from _mist_cases import load
from _mist_pricing import MEGATRON_PRECISION, _budget, hardware_of, model_of
from rich.console import Console
from rich.table import Table

from lynx.cost.optimizer_offload import CpuOffload
from lynx.cost.static_memory import OptimizerPrecision
from lynx.problem import PlanOptions
from lynx.search import Pins, Space, search

FRACTIONS = (0.25, 0.5, 0.875, 1.0)
"""The offload fractions tried: a quarter, half, Mist's largest choice (gpt 7b), all."""
CASES = ("l4-gpt-7b-flash", "l4-llama-7b-flash", "l4-gpt-7b-noflash")
"""The measured L4 cases on which Mist's configuration offloads optimizer state (benchmarks/data/mist_artifact.yaml)."""


def pick(case, precision: str, fraction: float | None) -> tuple[str, float]:  # type: ignore[no-untyped-def]
    """The search's pick and its price (inf: nothing fits) with `fraction` of the optimizer on the host (None: off)."""
    hw = hardware_of(case)
    space = Space(model=model_of(case), hardware=hw, gpus=case.gpus, global_batch=case.global_batch,
                  seq_len=case.seq, pins=Pins(), offload=hw.host() is not None)
    opt = OptimizerPrecision() if fraction is None else \
        OptimizerPrecision(use_precision_aware_optimizer=True, cpu_offload=CpuOffload(fraction, overlap=True))
    base = PlanOptions(precision=precision, overlap_grad_reduce=True, nodes=case.nodes, budget_bytes=_budget(hw),
                       check_for_nan_in_grad=False, optimizer_precision=opt)
    best = search(space, base, top=10).best
    if best is None:
        return "nothing fits", math.inf
    return f"{best.candidate.layout.label()} {best.candidate.method}", best.iteration_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _results.add_option(ap, "mist_optimizer_offload")
    args = ap.parse_args(argv)
    run = _results.Run()
    art = load()
    settings = [("fp16", MEGATRON_PRECISION, None), ("bf16", "megatron-bf16", None),
                *((f"bf16 offload {f:g}", "megatron-bf16", f) for f in FRACTIONS)]
    tab = Table(title="lynx's pick on Mist's L4 workloads with Megatron-Core's optimizer CPU offload (s per iteration)")
    tab.add_column("case")
    tab.add_column("Mist measured", justify="right")
    for name, _, _ in settings:
        tab.add_column(name, justify="right")
    tab.add_column("best with offload / fp16 pick", justify="right")
    figures: list[_results.Figure] = []
    for case in art.cases:
        if case.measured is None or case.id not in CASES:
            continue
        got = [pick(case, prec, frac) for _, prec, frac in settings]
        fp16 = got[0][1]
        offload = min(s for _, s in got[2:])
        tab.add_row(case.id, f"{case.measured.mist_iteration_s:.2f}", *(f"{s:.2f}" for _, s in got),
                    f"{offload / fp16:.3f}")
        for (name, _, _), (label, s) in zip(settings, got, strict=True):
            figures.append(_results.Figure(f"{case.id}: pick, {name} ({label})", round(s, 3), "s",
                                           reference=case.measured.mist_iteration_s))
        figures.append(_results.Figure(f"{case.id}: best pick with the offload over the fp16 pick",
                                       round(offload / fp16, 4), "x"))
        print(f"{case.id}: done", file=sys.stderr, flush=True)
    Console(width=200).print(tab)
    print(f"load average {os.getloadavg()[0]:.2f} (shared machine; the figures are predictions, not timings)")
    run.write(args.results, "mist_optimizer_offload", "prediction",
              "lynx's pick on Mist's L4 workloads with Megatron-Core's optimizer CPU offload, beside the fp16 pick",
              figures, notes=("reference: Mist's measured iteration time (s) on the same case",
                              "Megatron-Core's optimizer CPU offload needs --use-precision-aware-optimizer, which lynx "
                              "prices under --bf16 only (lynx.checks, decision 0250): the fp16 pick cannot use it"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
