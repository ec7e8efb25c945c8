"""Offloading as lynx's third choice (docs/offload.md): the judged cases and HEU's solve time with offload.

1. `--compare` on Llama-3-70B on 64 H100 (TP 8, PP 8, SP, micro-batch 1, global batch 128) at sequence 8192 and
   32768, and Llama-3.1-405B on 1,024 H100 (TP 8, PP 16, DP 8, SP, global batch 1024, sequence 8192; Megatron's
   baselines on its --decoder-first/last-pipeline-num-layers 7 layout, 126 layers not dividing by 16), each at
   the default budget and, where keeping everything with lynx already costs nothing, a tighter one. Target:
   the best offloading plan fits and is predicted at least as fast as lynx without offloading and faster than
   Megatron-Core's stock offloading (`mc-offload`) unless that does not fit.
2. HEU with offload per stage on the 175B (GPT-175B, 8 x 8 H100, TP 8 PP 8, mb 1, gb 512, seq 2048) and the 70B
   plans (seq 8192 and 32768; and interleaved, TP 4 PP 4 VPP 4 DP 4, one offload set per chunk): target at most
   50 ms per stage (median over repeats, the slowest stage).
3. The configuration search (`lynx plan --gpus N`) with and without offloading (`--offload` / `--no-offload`) on
   the judged cases: Llama-3-70B on 64 H100 at 8192 and 32768 (global batch 128) and Llama-3.1-405B on 1,024 H100
   (global batch 1024), sequence parallelism, layout searched, the device's budget. Each way: the search's pick,
   its iteration, largest stage peak and headroom; with offloading also the fastest Megatron-Core stock-offloading
   (`mc-offload`) candidate it planned (a pruned one has a time bound above the pick's time). Target: the pick
   with offloading is at least as fast as without and faster than every mc-offload plan that fits.

Run: python benchmarks/offload.py [--repeats 3] [--markdown] [--part compare|heu|search]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _results
from _markdown import Out
from _targets import Targets
from rich.table import Table

from lynx.api import compare, make_problem
from lynx.methods import base_partition
from lynx.models import load_model
from lynx.policy.heu import HeuOptions, heu_policy
from lynx.policy.offload import offload_link
from lynx.problem import PlanOptions, PlanProblem
from lynx.search import Pins, Space, search
from lynx.spec import ParallelSpec, load_hardware

METHODS = ["lynx", "lynx-offload", "mc-offload", "offload-all"]
HEU_STAGE_S = 0.050
CASES: list[tuple[str, str, int, int, int, int, int, float | None, int | None]] = [
    # label, model, tp, pp, dp, global batch, seq, budget GiB (None: the device's), Megatron first/last layers
    ("Llama-3-70B, 64 H100, seq 8192", "llama3-70b", 8, 8, 1, 128, 8192, None, None),
    ("Llama-3-70B, 64 H100, seq 8192, 24 GiB", "llama3-70b", 8, 8, 1, 128, 8192, 24.0, None),
    ("Llama-3-70B, 64 H100, seq 32768", "llama3-70b", 8, 8, 1, 128, 32768, None, None),
    ("Llama-3-70B, 64 H100, seq 32768, no SP", "llama3-70b", 8, 8, 1, 128, -32768, None, None),
    ("Llama-3.1-405B, 1024 H100, seq 8192", "llama3.1-405b", 8, 16, 8, 1024, 8192, None, 7),
]


def problem(model: str, tp: int, pp: int, dp: int, gb: int, seq: int, budget: float | None,
            ends: int | None) -> PlanProblem:
    par = ParallelSpec(tp=tp, pp=pp, dp=dp, sequence_parallel=seq > 0, micro_batch_size=1, global_batch_size=gb,
                       seq_length=abs(seq))  # a negative sequence: without sequence parallelism
    hw = load_hardware("h100-80g-nvlink")
    opts = PlanOptions(budget_bytes=None if budget is None else budget * (1 << 30),
                       decoder_first_pipeline_num_layers=ends, decoder_last_pipeline_num_layers=ends,
                       nodes=tp * pp * dp // hw.devices_per_node)
    return make_problem(load_model(model), hw, par, opts)


def judged(out: Out, tg: Targets) -> None:
    t = Table(title="offloading in --compare (iteration s; peak GiB is the largest stage's)", title_justify="left")
    for c in ("case", *METHODS, "best offload vs lynx", "target: fits, <= lynx, < mc-offload (or it OOMs)", "holds"):
        t.add_column(c, justify="right" if c != "case" else "left")
    for label, model, tp, pp, dp, gb, seq, budget, ends in CASES:
        prob = problem(model, tp, pp, dp, gb, seq, budget, ends)
        rows = {r.method: r for r in compare(prob, METHODS)}
        cells, times = [], {}
        for m in METHODS:
            r = rows[m]
            if r.plan is None:
                cells.append("no plan")
                continue
            s = r.plan.sim
            peak = max(st.peak_memory_bytes for st in s.stages) / (1 << 30)
            cells.append(f"{s.iteration_time_s:.3f} ({peak:.1f}{' OOM' if s.oom else ''})")
            if not s.oom:
                times[m] = s.iteration_time_s
        offl = [times[m] for m in ("lynx-offload", "offload-all") if m in times]
        best = min(offl) if offl else None
        lynx = times.get("lynx")
        mc = times.get("mc-offload")
        ok = None if best is None or lynx is None else (best <= lynx * (1 + 1e-9) and (mc is None or best < mc))
        gain = "" if best is None or lynx is None else f"{(lynx - best) / lynx:+.2%}"
        t.add_row(label, *cells, gain, "fits, <= lynx, < mc-offload (or it OOMs)", tg.add(label, ok))
    out.print(t)


def heu_speed(out: Out, tg: Targets, repeats: int) -> None:
    t = Table(title="HEU with offload, per stage ILP (median of repeats, slowest stage)", title_justify="left")
    for c in ("plan", "stages solved", "median ms", "slowest ms", "without offload: slowest ms", "target ms",
              "holds"):
        t.add_column(c, justify="right" if c != "plan" else "left")
    plans = [("gpt-175b, 8x8 H100, seq 2048", "gpt-175b", 512, 2048),
             ("llama3-70b, 8x8 H100, seq 8192", "llama3-70b", 128, 8192),
             ("llama3-70b, 8x8 H100, seq 32768", "llama3-70b", 128, 32768)]
    plans.append(("llama3-70b, TP4 PP4 VPP4 DP4 (64 H100), seq 8192", "llama3-70b", 128, 8192))
    for label, model, gb, seq in plans:
        prob = problem(model, 8, 8, 1, gb, seq, None, None)
        if "VPP4" in label:  # the 70B search's interleaved pick: HEU with one offload set per chunk
            hw = load_hardware("h100-80g-nvlink")
            par = ParallelSpec(tp=4, pp=4, dp=4, sequence_parallel=True, micro_batch_size=1, global_batch_size=gb,
                               seq_length=seq)
            prob = make_problem(load_model(model), hw, par, PlanOptions(vpp=4, nodes=8))
        opts = HeuOptions(offload=offload_link(prob.hardware), skip_when_all_fit=False)
        plain = HeuOptions(skip_when_all_fit=False)
        per_stage: dict[int, list[float]] = {}
        base: dict[int, list[float]] = {}
        for _ in range(repeats):
            for ctx in prob.stage_contexts(base_partition(prob)):
                for o, into in ((opts, per_stage), (plain, base)):
                    t0 = time.perf_counter()
                    heu_policy(ctx, prob.graph, o)
                    into.setdefault(ctx.stage, []).append(time.perf_counter() - t0)
        meds = [statistics.median(v) for v in per_stage.values()]
        slow = max(meds)
        slow_plain = max(statistics.median(v) for v in base.values())
        t.add_row(label, str(len(meds)), f"{statistics.median(meds) * 1e3:.1f}", f"{slow * 1e3:.1f}",
                  f"{slow_plain * 1e3:.1f}",
                  f"{HEU_STAGE_S * 1e3:.0f}", tg.at_most(f"HEU offload {label}", slow, HEU_STAGE_S))
    out.print(t)


SEARCHED = [
    # label, model, GPUs, global batch, sequence
    ("Llama-3-70B, 64 H100, seq 8192", "llama3-70b", 64, 128, 8192),
    ("Llama-3-70B, 64 H100, seq 32768", "llama3-70b", 64, 128, 32768),
    ("Llama-3.1-405B, 1024 H100, seq 8192", "llama3.1-405b", 1024, 1024, 8192),
]


def searched(out: Out, tg: Targets) -> None:
    t = Table(title="the configuration search with vs without offloading (the device's budget)",
              title_justify="left")
    for c in ("case", "offloading", "pick", "iteration s", "peak GiB", "headroom GiB", "search s",
              "best mc-offload s (peak GiB)", "target", "holds"):
        t.add_column(c, justify="left" if c in ("case", "pick", "target") else "right")
    hw = load_hardware("h100-80g-nvlink")
    for label, model, gpus, gb, seq in SEARCHED:
        picks = {}
        for on in (False, True):
            space = Space(load_model(model), hw, gpus, gb, seq, Pins(sp=True), offload=on)
            res = search(space, PlanOptions())
            b = res.best
            picks[on] = b
            mc = [o for o in res.ranked if o.candidate.method == "mc-offload"]
            mc_cell = "-" if not on else (f"{mc[0].iteration_s:.3f} ({max(mc[0].stage_peak_gib):.1f})" if mc
                                          else "none fits")
            if b is None:
                t.add_row(label, "on" if on else "off", "nothing fits", "-", "-", "-", f"{res.seconds:.0f}", mc_cell,
                          "", "")
                continue
            target, holds = "", ""
            if on:
                off = picks[False]
                ok = off is not None and b.iteration_s <= off.iteration_s * (1 + 1e-9) and (
                    not mc or b.iteration_s < mc[0].iteration_s)
                target = "<= without, < every mc-offload plan that fits"
                holds = tg.add(f"searched {label}", ok if off is not None else None)
                if off is not None:
                    target += f" ({(off.iteration_s - b.iteration_s) / off.iteration_s:+.2%} vs without)"
            t.add_row(label, "on" if on else "off", f"{b.candidate.layout.label()} {b.candidate.method}",
                      f"{b.iteration_s:.3f}", f"{max(b.stage_peak_gib):.1f}", f"{b.headroom_gib:.1f}",
                      f"{res.seconds:.0f}", mc_cell, target, holds)
    out.print(t)



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--part", choices=["all", "compare", "heu", "search"], default="all")
    _results.add_option(ap, "offload")
    args = ap.parse_args()
    run_results = _results.Run()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: must be at least 1")
    out, tg = Out(args.markdown), Targets()
    if args.part in ("all", "compare"):
        judged(out, tg)
    if args.part in ("all", "heu"):
        heu_speed(out, tg, args.repeats)
    if args.part in ("all", "search"):
        searched(out, tg)
    out.print(tg.summary())
    run_results.write(args.results, "offload", "measurement",
                      "Offloading as a third choice: the judged cases, HEU's solve time, the search's gain",
                      _results.figures_of(tg), tg.summary())


if __name__ == "__main__":
    main()
