"""The HEU-versus-OPT study (paper sec. 6.4, Figure 13): search time and simulated throughput of Checkmate,
Lynx-OPT and Lynx-HEU on GPT-300M-shaped stages (micro-batch 32, A100 NVLink cluster, TP 4, PP 4), and how
the search time grows with the number of layers in a stage.

    python benchmarks/heu_vs_opt.py table  [--time-limit 60] [--budget-gb 12]
    python benchmarks/heu_vs_opt.py growth --png docs/img/heu_vs_opt_growth.png [--time-limit 60]

`table` plans the whole model on the dp partition with each method and simulates it; one more row starts
Lynx-OPT's search from Lynx-HEU's policy (a MILP warm start), so its time-limited answer is never worse.
GPT-300M fits a 40 GB A100 without any recomputation under our cost model, so the study caps the usable
memory (--budget-gb, default 12 GiB) to make recomputation necessary. `growth` solves one stage (stage 1
of 4, three micro-batches in flight) with 1, 2, 4, 8, ... layers, its budget halfway between full
recomputation's peak and no recomputation's peak, until Lynx-OPT and Checkmate stop proving optimality
within the time limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import _results

from lynx.api import make_problem
from lynx.cost.memory import stage_peak_bytes
from lynx.decisions import RecomputePolicy, StageContext
from lynx.graph import LayerGraph
from lynx.models import load_model
from lynx.policy.heu import HeuOptions, critical_recompute, heu_policy
from lynx.policy.opt import OptOptions, SolverTimeoutError, checkmate_options, solve_stage
from lynx.policy.rules import full_policy, none_policy
from lynx.problem import PlanOptions, PlanProblem, PlanResult
from lynx.simulate import simulate
from lynx.spec import ParallelSpec, load_hardware

GiB = float(1 << 30)
METHODS = ("checkmate", "lynx-opt", "lynx-heu")
HEU_START = "lynx-opt (HEU start)"


def problem(budget_gb: float | None, time_limit: float) -> PlanProblem:
    par = ParallelSpec(tp=4, pp=4, dp=1, micro_batch_size=32, global_batch_size=128, seq_length=1024)
    opts = PlanOptions(budget_bytes=None if budget_gb is None else budget_gb * GiB, time_limit_s=time_limit)
    return make_problem(load_model("gpt-300m"), load_hardware("a100-40g-nvlink"), par, opts)


def stage_solve(method: str, ctx: StageContext, g: LayerGraph, time_limit: float) -> tuple[RecomputePolicy, float]:
    """One stage with one method: (policy, wall seconds)."""
    t0 = time.perf_counter()
    if method == "lynx-heu":
        pol = heu_policy(ctx, g, HeuOptions(time_limit_s=time_limit))
    elif method == HEU_START:  # OPT's search started from HEU's policy (a MILP warm start)
        heu = heu_policy(ctx, g, HeuOptions(time_limit_s=time_limit))
        pol = solve_stage(ctx, g, OptOptions(time_limit_s=time_limit, start=heu.layers)).policy
    else:
        opts = checkmate_options(time_limit) if method == "checkmate" else OptOptions(time_limit_s=time_limit)
        pol = solve_stage(ctx, g, opts).policy
    return pol, time.perf_counter() - t0


def table(args: argparse.Namespace) -> dict[str, Any]:
    from lynx.methods import base_partition

    p = problem(args.budget_gb, args.time_limit)
    part = base_partition(p)
    rows: dict[str, Any] = {}
    for method in (*METHODS, HEU_START):
        pols, secs = [], 0.0
        for ctx in p.stage_contexts(part):
            print(f"[{method}] stage {ctx.stage}: {ctx.num_layers} layers ...", file=sys.stderr, flush=True)
            pol, s = stage_solve(method, ctx, p.graph, args.time_limit)
            pols.append(pol)
            secs += s
        res = PlanResult(method, part, tuple(pols), search_time_s=secs)
        sim = simulate(p, res.partition, res.policies, record=False)
        rows[method] = {
            "search_s": secs, "samples_per_s": sim.samples_per_s, "iteration_s": sim.iteration_time_s,
            "oom": sim.oom, "recompute_critical_s": sim.recompute_critical_s,
            "stages": [{"status": q.stats.status, "gap": q.stats.mip_gap, "solve_s": q.stats.solve_time_s,
                        "variables": q.stats.num_variables, "constraints": q.stats.num_constraints}
                       for q in pols],
        }
    opt = rows["lynx-opt"]["samples_per_s"]
    print(f"\nGPT-300M, micro-batch 32, a100-40g-nvlink TP4 PP4, partition {part}, "
          f"budget {p.budget_bytes / GiB:.1f} GiB, time limit {args.time_limit:g} s per stage")
    print("| method | search time (s) | samples/s | vs Lynx-OPT | critical recompute (s) | fits | stage status (gap) |")
    print("|---|---:|---:|---:|---:|---|---|")
    for m, r in rows.items():
        st = ", ".join(f"{s['status']}" + (f" ({s['gap']:.1%})" if s["status"] == "time_limit" else "")
                       for s in r["stages"])
        print(f"| {m} | {r['search_s']:.2f} | {r['samples_per_s']:.2f} | {r['samples_per_s'] / opt:.2%} | "
              f"{r['recompute_critical_s']:.4f} | {'no' if r['oom'] else 'yes'} | {st} |")
    return {"partition": str(part), "budget_gb": p.budget_bytes / GiB, "rows": rows}


def growth_point(method: str, p: PlanProblem, layers: int, frac: float, tl: float) -> dict[str, Any]:
    g = p.graph
    ctx = p.stage_context(1, layers)
    lo = stage_peak_bytes(g, full_policy(ctx, g).layers, ctx)
    hi = stage_peak_bytes(g, none_policy(ctx, g).layers, ctx)
    ctx = dataclasses.replace(ctx, budget_bytes=lo + frac * (hi - lo))
    try:
        pol, secs = stage_solve(method, ctx, g, tl)
    except SolverTimeoutError:
        return {"method": method, "layers": layers, "status": "no_solution", "search_s": tl}
    crit = critical_recompute(g, pol.layers, ctx)
    lt = simulate_stage_time(g, layers, crit, ctx)
    return {"method": method, "layers": layers, "status": pol.stats.status, "gap": pol.stats.mip_gap,
            "search_s": secs, "critical_ms": crit * 1e3, "stage_time_ms": lt * 1e3,
            "variables": pol.stats.num_variables, "constraints": pol.stats.num_constraints}


def simulate_stage_time(g: LayerGraph, layers: int, crit: float, ctx: StageContext) -> float:
    """Per-micro-batch time of the stage in steady 1F1B: forward + backward (exposed collectives) + the
    critical-path recomputation, as the simulator charges it."""
    bwd = sum(o.bwd_time for o in g.ops if not o.is_comm) + g.exposed_bwd_comm(ctx.subtract_wgrad)
    return layers * (g.fwd_time() + bwd) + crit


def growth(args: argparse.Namespace) -> dict[str, Any]:
    p = problem(None, args.time_limit)
    pts: list[dict[str, Any]] = json.loads(Path(args.from_json).read_text())["points"] if args.from_json else []
    alive = set() if args.from_json else set(METHODS)
    layers = 1
    while alive and layers <= args.max_layers:
        for m in METHODS:
            if m not in alive:
                continue
            print(f"[{m}] {layers} layers ...", file=sys.stderr, flush=True)
            pt = growth_point(m, p, layers, args.frac, args.time_limit)
            pts.append(pt)
            if pt["status"] != "optimal" and m != "lynx-heu":
                alive.discard(m)  # hit the time limit: the curve stops here
        layers *= 2
    print(f"\nGrowth (stage 1 of 4, budget {args.frac:.0%} of the way from full to none), time limit "
          f"{args.time_limit:g} s")
    print("| layers | method | status | search (s) | variables | critical recompute (ms/mb) | stage time (ms/mb) |"
          " HEU/OPT stage throughput |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for pt in pts:
        ratio = ""
        if pt["method"] == "lynx-heu":
            opt = [q for q in pts if q["method"] == "lynx-opt" and q["layers"] == pt["layers"]]
            if opt and "stage_time_ms" in opt[0]:
                ratio = f"{opt[0]['stage_time_ms'] / pt['stage_time_ms']:.2%}" + (
                    "" if opt[0]["status"] == "optimal" else f" (OPT {opt[0]['status']})")
        gap = f" ({pt.get('gap', 0):.1%})" if pt["status"] == "time_limit" else ""
        print(f"| {pt['layers']} | {pt['method']} | {pt['status']}{gap} | {pt['search_s']:.2f} | "
              f"{pt.get('variables', 0)} | {pt.get('critical_ms', float('nan')):.3f} | "
              f"{pt.get('stage_time_ms', float('nan')):.2f} | {ratio} |")
    if args.png:
        plot(pts, Path(args.png), args.time_limit)
    return {"frac": args.frac, "points": pts}


def table_figures(rows: dict[str, dict[str, Any]]) -> list[_results.Figure]:
    """Each method's search time and simulated throughput as a share of Lynx-OPT's (the paper's figures beside)."""
    opt = rows["lynx-opt"]["samples_per_s"]
    out = []
    for m, r in rows.items():
        out.append(_results.Figure(f"{m}: simulated throughput as a share of lynx-opt's", round(100 * r["samples_per_s"]
                                   / opt, 2), "%", reference=97.8 if m == "lynx-heu" else None))
        out.append(_results.Figure(f"{m}: search time", round(r["search_s"], 2), "s",
                                   reference=0.5 if m == "lynx-heu" else None))
    return out


def plot(pts: list[dict[str, Any]], path: Path, tl: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, mark in zip(METHODS, ("s", "o", "^"), strict=True):
        xs = [q["layers"] for q in pts if q["method"] == m]
        ys = [max(q["search_s"], 1e-3) for q in pts if q["method"] == m]
        ax.plot(xs, ys, marker=mark, label=m)
        stop = [(q["layers"], max(q["search_s"], 1e-3)) for q in pts if q["method"] == m and q["status"] != "optimal"]
        if stop:
            ax.scatter([x for x, _ in stop], [y for _, y in stop], s=120, facecolors="none", edgecolors="red",
                       zorder=3)
    ax.axhline(tl, color="grey", linestyle="--", linewidth=1, label=f"time limit {tl:g} s (red: not proved optimal)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("transformer layers in the stage")
    ax.set_ylabel("policy search time (s)")
    ax.set_title("GPT-300M stage, micro-batch 32, A100 NVLink TP4")
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="whole-model plans: search time and simulated throughput")
    t.add_argument("--budget-gb", type=float, default=12.0)
    g = sub.add_parser("growth", help="search time against layers per stage, with a PNG curve")
    g.add_argument("--png", default=None)
    g.add_argument("--frac", type=float, default=0.5)
    g.add_argument("--max-layers", type=int, default=64)
    g.add_argument("--from-json", default=None, help="redraw the table and PNG from an earlier --json")
    for a in (t, g):
        a.add_argument("--time-limit", type=float, default=60.0)
        a.add_argument("--json", default=None, help="also write the raw results here")
    _results.add_option(t, "heu_vs_opt")
    args = ap.parse_args()
    run = _results.Run()
    out = table(args) if args.cmd == "table" else growth(args)
    if args.cmd == "table":
        run.write(args.results, "heu_vs_opt", "measurement", "Lynx-HEU against Lynx-OPT and Checkmate on GPT-300M "
                  "(the paper's sec. 6.4)", table_figures(out["rows"]),
                  notes=("The paper: HEU at 97.8% of OPT's throughput in 0.5 s against 14 hours.",))
    out["machine"] = f"{platform.processor() or platform.machine()}, {platform.python_version()}"
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
