"""Predicted comparison for the models people train today: Llama-3 8B and 70B with flash attention, grouped-
query attention, SwiGLU and untied embeddings, beside Megatron-Core's baselines (full, block, selective =
--recompute-modules core_attn, and the module lists mlp, layernorm, core_attn mlp, mlp layernorm).

Layouts (TP x PP, sequence parallelism on, as Megatron's LLaMA recipes run): llama3-8b TP 2 x PP 2 on
h100-80g-nvlink and TP 4 x PP 2 on a100-40g-nvlink; llama3-70b TP 8 x PP 4 on h100-80g-nvlink and TP 4 x PP 16
(16 nodes) on a100-40g-nvlink, the smallest A100-40G layout whose parameters and optimizer states fit.
Micro-batch 1-4, sequence 4096 and 8192, 4 x PP micro-batches per iteration. Cells: predicted samples/s;
OOM: a stage over budget in the simulator; inf: the method finds no policy that fits.

Run: python benchmarks/llama_grid.py [--models llama3-8b] [--seqs 4096] [--markdown] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import _results
from _markdown import Out
from rich.table import Table

from lynx.api import CompareRow, compare, make_problem
from lynx.methods import available_methods
from lynx.models import load_model
from lynx.policy.rules import keep_all, selective_layer
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec, load_hardware

LAYOUTS = {  # (model, hardware) -> (tp, pp, nodes)
    ("llama3-8b", "h100-80g-nvlink"): (2, 2, 1), ("llama3-8b", "a100-40g-nvlink"): (4, 2, 2),
    ("llama3-70b", "h100-80g-nvlink"): (8, 4, 4), ("llama3-70b", "a100-40g-nvlink"): (4, 16, 16),
}
METHODS = ("none", "full", "block", "selective", "mc-mlp", "mc-layernorm", "mc-core_attn+mlp", "mc-mlp+layernorm",
           "adapipe", "lynx-heu", "lynx")
MICRO_BATCHES = (1, 2, 3, 4)
SEQS = (4096, 8192)


@dataclass(frozen=True, slots=True)
class Cell:
    samples_per_s: float | None
    """None: OOM in the simulator or no policy fits."""
    status: str
    crit_s: float = 0.0


def cell(r: CompareRow) -> Cell:
    if r.plan is None:  # "refused": Megatron has no even split of the layers over PP (a baseline's row)
        return Cell(None, "refused" if "Megatron refuses" in r.error else "inf")
    s = r.plan.sim
    if s.oom:
        return Cell(None, "OOM")
    return Cell(s.samples_per_s, "ok", sum(st.recompute_critical_s for st in s.stages))


def run(models: tuple[str, ...], seqs: tuple[int, ...], sp: bool) -> list[dict[str, object]]:
    methods = [m for m in METHODS if m in available_methods()]
    rows: list[dict[str, object]] = []
    for (model, hw), (tp, pp, nodes) in LAYOUTS.items():
        if model not in models:
            continue
        for seq in seqs:
            for mb in MICRO_BATCHES:
                par = ParallelSpec(tp=tp, pp=pp, sequence_parallel=sp, micro_batch_size=mb,
                                   global_batch_size=4 * pp * mb, seq_length=seq)
                prob = make_problem(load_model(model), load_hardware(hw), par, PlanOptions(nodes=nodes))
                g = prob.graph
                sel_saves = 1 - g.retained_bytes(selective_layer(g).keep) / g.retained_bytes(keep_all(g).keep)
                res: dict[str, Cell] = {r.method: cell(r) for r in compare(prob, methods)}
                rows.append({"model": model, "hardware": hw, "tp": tp, "pp": pp, "sp": sp, "seq": seq,
                             "micro_batch": mb,
                             "selective_saves": sel_saves,
                             "cells": {k: {"samples_per_s": v.samples_per_s, "status": v.status, "crit_s": v.crit_s}
                                       for k, v in res.items()}})
    return rows


def best_megatron(sps: dict[str, float | None]) -> float | None:
    """The fastest Megatron setting that fits: full, block, selective or a module list (not none)."""
    return max((v for m, v in sps.items() if v and m not in ("lynx", "lynx-heu", "adapipe", "none")), default=None)


def _stat(sps: list[dict[str, float | None]], base: str) -> str:
    """Mean (max) of lynx / base over the cells where both fit; base "best": the best Megatron setting."""
    rs = []
    for s in sps:
        b = best_megatron(s) if base == "best" else s.get(base)
        lx = s.get("lynx")
        if lx and b:
            rs.append(lx / b)
    return f"{statistics.mean(rs):.3f}x ({max(rs):.3f}x)" if rs else "-"


def summary(rows: list[dict[str, object]]) -> Table:
    t = Table(title="lynx over the cells where both fit: mean (max)", title_justify="left")
    for c in ("model", "hardware", "cells", "vs full", "vs best Megatron", "vs adapipe", "cells where none fits"):
        t.add_column(c)
    for model, hw in LAYOUTS:
        sel = [r for r in rows if r["model"] == model and r["hardware"] == hw]
        if not sel:
            continue
        sps = [{m: c["samples_per_s"] for m, c in r["cells"].items()} for r in sel]  # type: ignore[attr-defined]
        t.add_row(model, hw, str(sum(1 for s in sps if s.get("lynx"))), _stat(sps, "full"), _stat(sps, "best"),
                  _stat(sps, "adapipe"), str(sum(1 for s in sps if s.get("none"))))
    return t


def table(rows: list[dict[str, object]], model: str, hw: str) -> Table:
    methods = [m for m in METHODS if m in available_methods()]
    sel = [r for r in rows if r["model"] == model and r["hardware"] == hw]
    tp, pp, _ = LAYOUTS[(model, hw)]
    sp = "SP" if sel and sel[0]["sp"] else "no SP"
    t = Table(title=f"{model} on {hw}, TP {tp} x PP {pp}, {sp}: predicted samples/s", title_justify="left")
    for c in ("seq", "mb", *methods, "lynx/full", "lynx/best Megatron"):
        t.add_column(c, justify="right")
    for r in sel:
        cells = r["cells"]
        assert isinstance(cells, dict)
        sps = {m: cells[m]["samples_per_s"] for m in methods}
        vals = [f"{sps[m]:.3f}" if sps[m] else f"[red]{cells[m]['status']}[/red]" for m in methods]
        best_mc = best_megatron(sps)
        lx = sps.get("lynx")
        ratios = [f"{lx / sps['full']:.3f}x" if lx and sps.get("full") else "-",
                  f"{lx / best_mc:.3f}x" if lx and best_mc else "-"]
        t.add_row(str(r["seq"]), str(r["micro_batch"]), *vals, *ratios)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="llama3-8b,llama3-70b")
    ap.add_argument("--seqs", default=",".join(map(str, SEQS)))
    ap.add_argument("--no-sp", action="store_true", help="Without sequence parallelism.")
    ap.add_argument("--json", default=None, help="Write the raw results here.")
    ap.add_argument("--markdown", action="store_true", help="Print tables as markdown.")
    _results.add_option(ap, "llama_grid")
    args = ap.parse_args()
    run_results = _results.Run()
    t0 = time.perf_counter()
    models = tuple(args.models.split(","))
    rows = run(models, tuple(int(s) for s in args.seqs.split(",")), not args.no_sp)
    con = Out(args.markdown)
    for model, hw in LAYOUTS:
        if model in models:
            con.print(table(rows, model, hw))
    con.print(summary(rows))
    saves = sorted({round(100 * float(r["selective_saves"]), 3) for r in rows})  # type: ignore[arg-type]
    con.print(f"selective (core_attn) recomputation frees {saves} % of a layer's activations (flash attention)")
    con.print(f"{len(rows)} cells in {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    run_results.write(args.results, "llama_grid", "prediction", "The LLaMA family: Llama-3 8B and 70B, lynx against "
                      f"Megatron's settings ({'SP' if not args.no_sp else 'no SP'}, predicted samples/s)",
                      figures(rows), notes=(f"{len(rows)} cells; mean (max) over the cells where both fit",))


def figures(rows: list[dict[str, object]]) -> list[_results.Figure]:
    """lynx over full recomputation and over the best Megatron setting, per model and hardware."""
    out = []
    for model, hw in LAYOUTS:
        sel = [r for r in rows if r["model"] == model and r["hardware"] == hw]
        sps = [{m: c["samples_per_s"] for m, c in r["cells"].items()} for r in sel]  # type: ignore[attr-defined]
        if sps:
            out += [_results.Figure(f"{model} on {hw}: lynx / full, mean (max)", _stat(sps, "full")),
                    _results.Figure(f"{model} on {hw}: lynx / best Megatron setting, mean (max)", _stat(sps, "best"))]
    return out


if __name__ == "__main__":
    main()
