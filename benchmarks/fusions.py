"""Fused (TransformerEngine, Megatron-Core's default) versus eager memory-bound ops, and the restored layer output
in the solvers' memory rows (docs/decisions/0083-fusion-switches.md, 0084). Predicted; no GPU needed.

Part 1 (`--part fusions`): Llama-3-8B and GPT-175B on H100, each planned three ways with Megatron's names:
  TE            the defaults (TransformerEngine, every fusion on);
  TE, eager     `--no-bias-swiglu-fusion --no-bias-gelu-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion
                --no-rope-fusion --no-gradient-accumulation-fusion` (the memory-bound ops alone);
  local         `--transformer-impl local` with the same flags (what a run without TransformerEngine uses:
                Megatron-Core's unfused attention besides);
and, per variant, methods none, full and lynx: iteration, the largest stage peak, what lynx recomputes per layer
(stage 0) and its critical recomputation. Targets: the TE row is the plan without flags (the defaults do not
move), eager is slower than fused, lynx is never slower than full.

Part 2 (`--part rows`): the paper's GPT-175B and Llama-3-70B plans (iteration, peak) for full, lynx-heu and lynx.
`--before-src DIR` runs the same cases with another checkout's `src` (e.g. main before this change) in a
subprocess and prints both. Target: lynx's plan fits its budget by the exact rule (never over).

Run from benchmarks/: `python fusions.py --markdown` (both parts), `python fusions.py --part rows --before-src
/work/main/src --markdown`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import _results

from lynx.api import make_problem, plan
from lynx.errors import InfeasibleError
from lynx.models import load_model
from lynx.problem import PlanOptions, PlanProblem
from lynx.spec import GiB, ParallelSpec, load_hardware

EAGER = dict(bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
             apply_rope_fusion=False, gradient_accumulation_fusion=False)
VARIANTS: dict[str, dict[str, Any]] = {
    "TE": {},
    "TE, eager": EAGER,
    "local": {**EAGER, "transformer_impl": "local", "attention": "standard"},
}

FUSION_CASES: dict[str, tuple[str, ParallelSpec, PlanOptions]] = {
    # Llama-3-8B at 8k on 8 H100s (TP 2, PP 4: 8 layers per stage), micro-batch 4: no recomputation does not fit
    "llama3-8b": ("llama3-8b", ParallelSpec(tp=2, pp=4, dp=1, sequence_parallel=True, micro_batch_size=4,
                                            global_batch_size=128, seq_length=8192),
                  PlanOptions(precision="megatron-bf16", distributed_optimizer=True)),
    # GPT-175B on 64 H100s as the configuration search's benchmark plans it, at micro-batch 2 (none does not fit)
    "gpt-175b": ("gpt-175b", ParallelSpec(tp=8, pp=8, dp=1, sequence_parallel=True, micro_batch_size=2,
                                          global_batch_size=256, seq_length=2048), PlanOptions()),
}

ROW_CASES: dict[str, tuple[str, str, ParallelSpec, PlanOptions]] = {
    # GPT-175B on 64 H100s (config_search.py's single plan), and at micro-batch 2 where lynx must recompute
    "gpt-175b TP8 PP8 SP mb1": ("gpt-175b", "h100-80g-nvlink", ParallelSpec(
        tp=8, pp=8, dp=1, sequence_parallel=True, micro_batch_size=1, global_batch_size=512, seq_length=2048),
        PlanOptions()),
    "gpt-175b TP8 PP8 SP mb2": ("gpt-175b", "h100-80g-nvlink", ParallelSpec(
        tp=8, pp=8, dp=1, sequence_parallel=True, micro_batch_size=2, global_batch_size=256, seq_length=2048),
        PlanOptions()),
    # Llama-3-70B at 8k under memory pressure (llama_grid: micro-batch 3, none OOM)
    "llama3-70b TP8 PP4 SP mb3": ("llama3-70b", "h100-80g-nvlink", ParallelSpec(
        tp=8, pp=4, dp=1, sequence_parallel=True, micro_batch_size=3, global_batch_size=96, seq_length=8192),
        PlanOptions()),
}


def _plan(problem: PlanProblem, method: str) -> dict[str, Any]:
    try:
        p = plan(problem, method, record=False)
    except InfeasibleError as e:
        return {"error": str(e).splitlines()[0]}
    from lynx.cost.memory import stage_peak_bytes

    peaks = [stage_peak_bytes(problem.graph, pol.layers, ctx)
             for pol, ctx in zip(p.result.policies, problem.stage_contexts(p.result.partition), strict=True)]
    pol0 = p.result.policies[0].layers[0]
    return {"iteration_s": p.sim.iteration_time_s, "peak_gib": max(peaks) / GiB, "oom": p.sim.oom,
            "budget_gib": problem.budget_bytes / GiB,
            "recomputed": sorted(n for n, _ in pol0.recompute)}


def fusion_rows() -> list[dict[str, Any]]:
    hw = load_hardware("h100-80g-nvlink")
    rows = []
    for case, (name, par, opts) in FUSION_CASES.items():
        base = load_model(name)
        for var, fields in VARIANTS.items():
            model = replace(base, **fields) if fields else base
            prob = make_problem(model, hw, par, opts)
            for method in ("none", "full", "lynx"):
                rows.append({"case": case, "variant": var, "method": method, **_plan(prob, method)})
    return rows


def rows_rows() -> list[dict[str, Any]]:
    out = []
    for case, (name, hw, par, opts) in ROW_CASES.items():
        prob = make_problem(load_model(name), load_hardware(hw), par, opts)
        for method in ("full", "lynx-heu", "lynx"):
            out.append({"case": case, "method": method, **_plan(prob, method)})
    return out


def _fmt(r: dict[str, Any], key: str, spec: str) -> str:
    return "-" if r.get(key) is None else format(r[key], spec)


def print_fusions(rows: list[dict[str, Any]]) -> int:
    bad = 0
    print("| model | variant | method | iteration s | largest stage peak GiB | budget GiB | lynx recomputes "
          "(stage 0, per layer) | target | holds |")
    print("|---|---|---|---:|---:|---:|---|---|---|")
    idx = {(r["case"], r["variant"], r["method"]): r for r in rows}
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | {r['variant']} | {r['method']} | {r['error']} | | | | | |")
            continue
        target, holds = "", ""
        te = idx.get((r["case"], "TE", r["method"]), {})
        full = idx.get((r["case"], r["variant"], "full"), {})
        if r["variant"] != "TE" and "iteration_s" in te:
            target, ok = "slower than TE", r["iteration_s"] > te["iteration_s"]
            holds = "yes" if ok else "NO"
            bad += not ok
            FIGURES.append(_results.Figure(f"{r['case']} {r['variant']} {r['method']}: iteration",
                                           round(r["iteration_s"], 3), "s", f"> TE's {te['iteration_s']:.3f}", ok))
        if r["method"] == "lynx" and "iteration_s" in full:
            ok = r["iteration_s"] <= full["iteration_s"] * (1 + 1e-9)
            target += ("; " if target else "") + "<= full"
            holds += ("; " if holds else "") + ("yes" if ok else "NO")
            bad += not ok
            FIGURES.append(_results.Figure(f"{r['case']} {r['variant']} lynx: iteration", round(r["iteration_s"], 3),
                                           "s", f"<= full's {full['iteration_s']:.3f}", ok))
        rec = ", ".join(r["recomputed"]) if r["method"] == "lynx" else ""
        peak = f"{r['peak_gib']:.1f}" + (" OOM" if r["oom"] else "")
        print(f"| {r['case']} | {r['variant']} | {r['method']} | {r['iteration_s']:.3f} | {peak} | "
              f"{r['budget_gib']:.1f} | {rec or ('-' if r['method'] == 'lynx' else '')} | {target} | {holds} |")
    return bad


def print_rows(rows: list[dict[str, Any]], before: list[dict[str, Any]] | None) -> int:
    bad = 0
    prev = {(r["case"], r["method"]): r for r in before or []}
    print("| case | method | iteration s | peak GiB | budget GiB | before: iteration s | before: peak GiB | "
          "lynx recomputes (stage 0, per layer) | target | holds |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|---|")
    for r in rows:
        b = prev.get((r["case"], r["method"]), {})
        if "error" in r:
            print(f"| {r['case']} | {r['method']} | {r['error']} | | | | | | | |")
            continue
        ok = r["peak_gib"] <= r["budget_gib"] * (1 + 1e-9) or r["method"] == "full"
        bad += not ok
        if r["method"] != "full":
            FIGURES.append(_results.Figure(f"{r['case']} {r['method']}: peak (restored output in the rows)",
                                           round(r["peak_gib"], 3), "GiB", f"<= budget {r['budget_gib']:.1f}", ok))
        rec = ", ".join(r["recomputed"]) if r["method"] != "full" else "all"
        print(f"| {r['case']} | {r['method']} | {r['iteration_s']:.3f} | {r['peak_gib']:.3f} | "
              f"{r['budget_gib']:.1f} | {_fmt(b, 'iteration_s', '.3f')} | {_fmt(b, 'peak_gib', '.3f')} | "
              f"{rec or '-'} | {'fits the budget' if r['method'] != 'full' else ''} | "
              f"{('yes' if ok else 'NO') if r['method'] != 'full' else ''} |")
    return bad


FIGURES: list[_results.Figure] = []
"""What each target compared, for `--results`."""

SECTION9_EAGER_MS = {  # one H100, 2026-11-23, eager PyTorch ops of lynx's runtime, fwd / bwd (git history)
    ("llama3-8b", "rope"): (0.58, 0.53), ("llama3-8b", "swiglu"): (0.43, 1.45),
    ("gpt-1.3b", "softmax"): (1.96, 1.92),
}


def section9_rows() -> int:
    """The project's own eager measurement (the H100 session's shapes) beside lynx's fused and eager prices. Target: the
    eager price is nearer the measured eager kernel than the fused one (forward and backward); nothing is fitted."""
    import math

    from lynx.cost.layer import build_layer_graph
    from lynx.spec import ModelSpec

    hw = load_hardware("h100-80g-nvlink")
    shapes = {"llama3-8b": (load_model("llama3-8b"), ParallelSpec(seq_length=4096, micro_batch_size=1)),
              "gpt-1.3b": (ModelSpec("gpt-1.3b", 24, 2048, 16, attention="standard"),
                           ParallelSpec(seq_length=2048, micro_batch_size=4, global_batch_size=4))}
    print("| layer (H100 shape) | op | measured eager fwd / bwd ms | lynx fused | lynx eager | eager / measured "
          "| target | holds |")
    print("|---|---|---|---|---|---|---|---|")
    bad = 0
    for (name, op), (mf, mb) in SECTION9_EAGER_MS.items():
        model, par = shapes[name]
        fused = build_layer_graph(model, hw, par).op(op)
        eager = build_layer_graph(replace(model, **EAGER), hw, par).op(op)
        ok = all(abs(math.log(e / m)) < abs(math.log(f / m)) for e, f, m in
                 ((eager.fwd_time * 1e3, fused.fwd_time * 1e3, mf), (eager.bwd_time * 1e3, fused.bwd_time * 1e3, mb)))
        bad += not ok
        FIGURES.append(_results.Figure(f"{name} {op}: eager price fwd / bwd against the measured eager kernel",
                                       f"{eager.fwd_time * 1e3:.2f} / {eager.bwd_time * 1e3:.2f} ms",
                                       target="nearer than the fused price", holds=ok,
                                       reference=f"{mf:.2f} / {mb:.2f} ms"))
        print(f"| {name} | {op} | {mf:.2f} / {mb:.2f} | {fused.fwd_time * 1e3:.2f} / {fused.bwd_time * 1e3:.2f} | "
              f"{eager.fwd_time * 1e3:.2f} / {eager.bwd_time * 1e3:.2f} | {eager.fwd_time * 1e3 / mf:.2f} / "
              f"{eager.bwd_time * 1e3 / mb:.2f} | eager nearer than fused | {'yes' if ok else 'NO'} |")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("fusions", "rows", "all"), default="all")
    ap.add_argument("--before-src", help="another checkout's src/ for part 2's 'before' columns")
    ap.add_argument("--markdown", action="store_true", help="(tables are markdown already)")
    ap.add_argument("--json", action="store_true", help="print part 2's rows as JSON (used by --before-src)")
    _results.add_option(ap, "fusions")
    a = ap.parse_args()
    run = _results.Run()
    if a.json:
        print(json.dumps(rows_rows()))
        return
    if a.before_src and not os.path.isfile(os.path.join(a.before_src, "lynx", "__init__.py")):
        ap.error(f"--before-src {a.before_src}: not a checkout's src/ (no lynx/__init__.py in it)")
    bad = 0
    if a.part in ("fusions", "all"):
        print("**Fused (TransformerEngine) vs eager memory-bound ops, H100 (predicted)**\n")
        bad += print_fusions(fusion_rows())
        print("\n**The eager prices beside the project's eager H100 profile (one H100, 2026-11-23)**\n")
        bad += section9_rows()
        print()
    if a.part in ("rows", "all"):
        before = None
        if a.before_src:
            env = {**os.environ, "PYTHONPATH": a.before_src}
            res = subprocess.run([sys.executable, __file__, "--json"], env=env, capture_output=True, text=True,
                                 check=True)
            before = json.loads(res.stdout)
        print("**The restored layer output in HEU's and OPT's rows: the paper's GPT-175B and Llama-3-70B "
              "(predicted)**\n")
        bad += print_rows(rows_rows(), before)
    print(f"\n{'every target holds' if not bad else f'{bad} target(s) do NOT hold'}")
    run.write(a.results, "fusions", "prediction", "Fused (TransformerEngine) against eager memory-bound ops; the "
              "restored layer output in the solvers' rows", FIGURES)


if __name__ == "__main__":
    main()
