"""What the windows hide, measured against its own noise. Needs root (network namespaces).

    python benchmarks/window_control.py --layout tp2    --out benchmarks/results/raw/window_control_tp2.json
    python benchmarks/window_control.py --layout pp2tp2 --out benchmarks/results/raw/window_control_pp2tp2.json
    python benchmarks/window_control.py --from-json benchmarks/results/raw/window_control_tp2.json
    python benchmarks/window_control.py --layout tp2 --smoke        # end to end in about a minute

Layouts: `tp2` is the set-up of testbed_experiment.py (TP 2, PP 1, 2 micro-batches of 2 x 256 tokens, the
4-layer GPT), `pp2tp2` that of pipeline_testbed.py (PP 2 x TP 2, 4 micro-batches; both stages of a TP rank
share its core); both profile and train with one torch thread per rank and plan on pipeline_testbed's
`testbed_hardware`. The layer is profiled inside the testbed, then one plan (A, `--method`, lynx by default) is
made under a per-stage budget of full's simulated peak + F x (none's - full's), and its window control (B: the
same policy and memory, every phase 1-4 recomputation and the cool-down stall moved on demand,
benchmarks/_window_control.py). Before any training the script prints the predicted window (hidden)
recomputation and the predicted B - A, and refuses when B - A is under `--min-signal` of the predicted
iteration time. `--budget-frac auto` (the default) plans every F in 0.05, 0.075 ... 0.975 (about 2 s of
planning) and keeps the F with the largest predicted B - A relative to the predicted iteration.

Why 400 Mbit/s and F = auto by default (planning only, profiles taken in the testbed on 2026-11-23): this
model's whole forward compute per layer and micro-batch is ~30 ms on this CPU, while a 1 MiB all-reduce takes
~86 ms at 100 Mbit/s. A slower link lengthens windows that are already far longer than what is recomputed in
them, and the iteration with them: the hidden seconds stay, their share shrinks (tp2: B - A predicted 0.06 s
of 3.3 s at 100 Mbit/s, 0.08 s of 1.36 s at 400). A small F (0.1-0.2) makes lynx recompute much but put
almost none of it in windows (a window restores tensors earlier, and that memory does not fit), so B - A is
~0. Larger F gives more: tp2 at 400 Mbit/s reaches 0.08 s of 1.36 s (5.9%) at F 0.45-0.625, pp2tp2 0.21 s of
1.66 s (12.5%) at F 0.75 and 0.85 -- but the planner's choice jumps with F (pp2tp2 at F 0.8: 0.08 s), which
is why `auto` scans a fine grid and prints what it picked. tp2 reached no more than 6% at any F or rate tried
(100-600 Mbit/s), hence `--min-signal` 0.04 rather than 0.1.

Design (A B A'): every round trains A, then B, then A again, each a fresh `python -m lynx.runtime.train` with
`--iters` timed iterations after one warm-up; `--rounds` rounds. Measured hidden = median(B) - median(A and
A'). Its noise: the same estimator on the plan against itself (the placebo: median of all A minus median of
all A'), or the standard error of the per-round B - A, whichever is larger; shown beside it, one run's noise
(median over rounds of |median(A) - median(A')|), the spread of the per-round B - A and the number of rounds
where B was slower. Targets: (a) measured hidden > 3 x the estimate's noise; (b) |measured - predicted| <=
0.25 x the recomputation time, taken as the engine's measured recomputation of the control (all of it on
demand; summed over stages) -- the predicted one is printed beside it. The engine's seconds are split into
windows (phases 1-4), cool-down and on demand per stage; for PP > 1 the last round's A and B also write a
timeline, summarised with the seconds of recomputation that overlapped a collective in flight
(`lynx.runtime.trace`).

Expected wall time at the defaults (12 timed iterations, 6 rounds: 18 training runs) on the 2-core VM: tp2
about 6 minutes (~1.25 s iterations, ~3 s start-up per run), pp2tp2 about 11 minutes (~2.2 s iterations with
both stages of a TP rank on one core, ~8 s start-up per run), plus ~10 s of profiling; `--smoke` under a
minute. Measured on a busy machine (smoke runs), so only a guide.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import _results  # noqa: E402
import pipeline_testbed as pt  # noqa: E402
from _targets import Targets  # noqa: E402
from _window_control import check_control_args, control_of  # noqa: E402


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    global_batch: int

    @property
    def world(self) -> int:
        return self.tp * self.pp


LAYOUTS = {"tp2": Layout(2, 1, 4), "pp2tp2": Layout(2, 2, 8)}
FRACS = tuple(round(0.025 * k, 3) for k in range(2, 40))  # 0.05, 0.075 ... 0.975
ROLES = ("A", "B", "A2")  # plan, control, plan again



def _repo_on_path() -> None:
    """The test harnesses (`tests.harness`) live beside the package, not in it: the repository root on the path."""
    import sys as _sys
    from pathlib import Path as _Path

    root = str(_Path(__file__).resolve().parents[1])
    if root not in _sys.path:
        _sys.path.insert(0, root)

def stage_peaks(model: Path, pid: int, db: Path, lay: Layout, rate: float) -> dict[str, list[float]]:
    from lynx.methods import get_method
    from lynx.plan import Plan

    prob = pt._problem(model, pid, db, lay.tp, lay.pp, rate, gb=lay.global_batch)
    return {m: [s.peak_memory_bytes for s in Plan.evaluate(prob, get_method(m).fn(prob)).sim.stages]
            for m in ("none", "full")}


def budget_of(peaks: dict[str, list[float]], frac: float) -> float:
    """full's peak + frac x (none's - full's), per stage; the plan takes one budget, so the largest of them."""
    return max(f + frac * (n - f) for f, n in zip(peaks["full"], peaks["none"], strict=True))


def predict(model: Path, pid: int, db: Path, lay: Layout, rate: float, frac: float, method: str,
            peaks: dict[str, list[float]]) -> tuple[dict[str, Any], Any, Any]:
    """The plan and its control at budget fraction `frac`, with what the simulator predicts for both."""
    from lynx.methods import get_method
    from lynx.plan import Plan

    budget = budget_of(peaks, frac)
    prob = pt._problem(model, pid, db, lay.tp, lay.pp, rate, budget, gb=lay.global_batch)
    res = get_method(method).fn(prob)
    plan, ctl = Plan.evaluate(prob, res), Plan.evaluate(prob, control_of(res))

    def stages(p: Any) -> list[dict[str, float]]:
        return [{"hidden_s": s.recompute_overlapped_s, "critical_s": s.recompute_critical_s, "oom": s.oom}
                for s in p.sim.stages]

    pred = {"budget_frac": frac, "budget_bytes": budget, "method": method,
            "plan_s": plan.sim.iteration_time_s, "control_s": ctl.sim.iteration_time_s,
            "hidden_s": ctl.sim.iteration_time_s - plan.sim.iteration_time_s,
            "plan_stages": stages(plan), "control_stages": stages(ctl)}
    pred["window_recompute_s"] = sum(s["hidden_s"] for s in pred["plan_stages"])
    pred["control_recompute_s"] = sum(s["hidden_s"] + s["critical_s"] for s in pred["control_stages"])
    return pred, plan, ctl


def choose(model: Path, pid: int, db: Path, lay: Layout, rate: float, frac: str, method: str
           ) -> tuple[dict[str, Any], Any, Any]:
    peaks = stage_peaks(model, pid, db, lay, rate)
    return best_fraction(lambda f: predict(model, pid, db, lay, rate, f, method, peaks), frac, peaks,
                         "window_control")


def best_fraction(predict_at: Callable[[float], tuple[dict[str, Any], Any, Any]], frac: str, peaks: Any,
                  name: str) -> tuple[dict[str, Any], Any, Any]:
    """The budget fraction F (`--budget-frac`, or each of FRACS for auto) whose plan hides the largest share of
    its iteration; SystemExit naming every F when no plan fits."""
    best: tuple[dict[str, Any], Any, Any] | None = None
    errors = []
    for f in FRACS if frac == "auto" else (float(frac),):
        try:
            cand = predict_at(f)
        except Exception as e:  # no policy fits this budget: try the next F
            errors.append(f"F={f:g}: {e}")
            continue
        if best is None or cand[0]["hidden_s"] / cand[0]["plan_s"] > best[0]["hidden_s"] / best[0]["plan_s"]:
            best = cand
    if best is None:
        raise SystemExit(f"{name}: --budget-frac: no plan at " + "; ".join(errors))
    best[0]["simulated_peaks"] = peaks
    return best


def prediction_text(pred: dict[str, Any], rate: float) -> str:
    share = pred["hidden_s"] / pred["plan_s"]
    return (f"plan {pred['method']} at F={pred['budget_frac']:g} (budget {pred['budget_bytes'] / 2**20:.1f} MiB), "
            f"{rate:g} Mbit/s: predicted iteration {pred['plan_s']:.3f} s, control {pred['control_s']:.3f} s; "
            f"window (hidden) recomputation {pred['window_recompute_s']:.3f} s, control's recomputation "
            f"{pred['control_recompute_s']:.3f} s; predicted control - plan {pred['hidden_s']:+.3f} s "
            f"({100 * share:.1f}% of the iteration)")


def train(tb: Any, plan_path: Path, out: Path, iters: int, world: int, trace: Path | None = None) -> dict[str, Any]:
    argv = [sys.executable, "-m", "lynx.runtime.train", "--plan", str(plan_path), "--iters", str(iters),
            "--warmup", "1", "--out", str(out), "--quiet", "--timeout", "300", "--threads", "1"]
    if trace is not None:
        argv += ["--trace", str(trace)]
    res = tb.run(argv, timeout=1800, world=world)
    pt._ok(res, f"training {plan_path.name}")
    return dict(json.loads(out.read_text()))


def run_summary(report: dict[str, Any]) -> dict[str, Any]:
    """Timed iteration times and the engine's recomputation seconds per stage and iteration, split into
    windows (phases 1-4), cool-down stalls and on demand (the pipeline runner reports them per stage, averaged
    over timed iterations; the TP-only runner per iteration, rank 0, and has no cool-down)."""
    timed = [it for it in report["iterations"] if not it["warmup"]]
    if "stages" in report:  # the engine's window_s includes its cool-down_s: split them
        stages = {s: {"window_s": st["window_s"] - st["cooldown_s"], "cooldown_s": st["cooldown_s"],
                      "ondemand_s": st["ondemand_s"]} for s, st in report["stages"].items()}
    else:
        stages = {"0": {"window_s": statistics.fmean(it["recompute_window_s"] for it in timed), "cooldown_s": 0.0,
                        "ondemand_s": statistics.fmean(it["recompute_ondemand_s"] for it in timed)}}
    return {"times": [it["time_s"] for it in timed], "median_s": statistics.median(it["time_s"] for it in timed),
            "stages": stages}


def timeline(trace: Path) -> dict[str, dict[str, float]]:
    """Per stage, from a pipeline run's timeline (its last iteration): recomputation seconds per place and
    the seconds of it that overlapped a collective in flight (`lynx.runtime.trace`)."""
    from lynx.runtime.trace import _measured_by_stage

    got = _measured_by_stage(json.loads(trace.read_text()))
    return {str(s): {k: d.get(k, 0.0) for k in ("window", "cooldown", "on_demand", "overlap")}
            for s, d in sorted(got.items())}


def _engine(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per stage, the median over runs of each kind of recomputation seconds."""
    return {s: {k: statistics.median(r["stages"][s][k] for r in runs) for k in ("window_s", "cooldown_s", "ondemand_s")}
            for s in runs[0]["stages"]}


def analyse(rounds: list[dict[str, dict[str, Any]]], pred: dict[str, Any]) -> dict[str, Any]:
    a_runs = [r[x] for r in rounds for x in ("A", "A2")]
    b_runs = [r["B"] for r in rounds]
    measured = (statistics.median(t for r in b_runs for t in r["times"])
                - statistics.median(t for r in a_runs for t in r["times"]))
    per_round = [r["B"]["median_s"] - (r["A"]["median_s"] + r["A2"]["median_s"]) / 2 for r in rounds]
    noise = statistics.median(abs(r["A"]["median_s"] - r["A2"]["median_s"]) for r in rounds)
    # the noise of the estimate itself: the same estimator on the plan against itself (all A against all A'),
    # and the standard error of the per-round differences; a single run's noise (above) is only shown
    placebo = abs(statistics.median(t for r in rounds for t in r["A"]["times"])
                  - statistics.median(t for r in rounds for t in r["A2"]["times"]))
    se = statistics.stdev(per_round) / len(per_round) ** 0.5 if len(per_round) > 1 else float("inf")
    est_noise = max(placebo, se)
    eng_a, eng_b = _engine(a_runs), _engine(b_runs)
    ctl_recompute = sum(sum(x.values()) for x in eng_b.values())
    return {"measured_hidden_s": measured, "per_round_s": per_round, "noise_aa_s": noise,
            "placebo_s": placebo, "per_round_se_s": se, "estimate_noise_s": est_noise,
            "spread_s": max(per_round) - min(per_round), "rounds_b_slower": sum(d > 0 for d in per_round),
            "predicted_hidden_s": pred["hidden_s"],
            "plan_median_s": statistics.median(t for r in a_runs for t in r["times"]),
            "control_median_s": statistics.median(t for r in b_runs for t in r["times"]),
            "engine_plan": eng_a, "engine_control": eng_b, "control_recompute_s": ctl_recompute,
            "beyond_noise": measured > 3 * est_noise,
            "agrees": ctl_recompute > 0 and abs(measured - pred["hidden_s"]) <= 0.25 * ctl_recompute}


def report_text(an: dict[str, Any], pred: dict[str, Any], t: Targets | None = None, label: str = "") -> str:
    """The run's tables and its two targets; `t` collects the checks (with their figures) for `--results`."""

    def eng(e: dict[str, dict[str, float]]) -> str:
        return ", ".join(f"{x['window_s']:.3f} + {x['cooldown_s']:.3f} / {x['ondemand_s']:.3f}" for x in e.values())

    t = Targets() if t is None else t
    a = t.add(f"{label}recomputation hidden per iteration, measured (s)", an["beyond_noise"],
              round(an["measured_hidden_s"], 3), f"> 3 x the estimate's noise {an['estimate_noise_s']:.3f}")
    b = t.add(f"{label}|measured - predicted {an['predicted_hidden_s']:.3f}| hidden (s)", an["agrees"],
              round(abs(an["measured_hidden_s"] - an["predicted_hidden_s"]), 3),
              f"<= 0.25 x the control's recomputation {an['control_recompute_s']:.3f}")
    lines = [
        "| plan A median s | control B median s | measured hidden s (B - A) | per round B - A s "
        "| one run's noise |A - A'| s | the estimate's noise s | predicted hidden s |", "|---|---|---|---|---|---|---|",
        f"| {an['plan_median_s']:.3f} | {an['control_median_s']:.3f} | {an['measured_hidden_s']:+.3f} | "
        + ", ".join(f"{d:+.3f}" for d in an["per_round_s"])
        + f" (spread {an['spread_s']:.3f}; B slower in {an['rounds_b_slower']} of {len(an['per_round_s'])}) | "
        f"{an['noise_aa_s']:.3f} | {an['estimate_noise_s']:.3f} (placebo all A - all A' {an['placebo_s']:.3f}, "
        f"s.e. of the rounds {an['per_round_se_s']:.3f}) | {an['predicted_hidden_s']:+.3f} |", "",
        "| run | engine recompute s per stage: window + cool-down / on demand | simulator hidden / critical s |",
        "|---|---|---|",
        f"| plan (A, A') | {eng(an['engine_plan'])} | "
        + ", ".join(f"{s['hidden_s']:.3f} / {s['critical_s']:.3f}" for s in pred["plan_stages"]) + " |",
        f"| control (B) | {eng(an['engine_control'])} | "
        + ", ".join(f"{s['hidden_s']:.3f} / {s['critical_s']:.3f}" for s in pred["control_stages"]) + " |", "",
        f"(a) beyond the noise: {an['measured_hidden_s']:+.3f} s > 3 x {an['estimate_noise_s']:.3f} s (the larger of "
        f"the placebo and the standard error): {a}",
        f"(b) agrees with the prediction: |{an['measured_hidden_s']:+.3f} - {an['predicted_hidden_s']:+.3f}| <= "
        f"0.25 x {an['control_recompute_s']:.3f} s (the control's recomputation the engine timed, summed over "
        f"stages; predicted {pred['control_recompute_s']:.3f} s): {b}", "", t.summary()]
    return "\n".join(lines).replace("[green]", "").replace("[/green]", "").replace("[red]", "").replace("[/red]", "")


TITLE = "What the windows hide: each plan against its control with every window moved on demand (lynx's layers)"


def replay_saved(paths: Path | list[Path], results: Path | None, benchmark: str, title: str,
                 label: Callable[[Path, dict[str, Any]], str]) -> None:
    """Re-print saved runs of a window control (this one's or window_control_torchtitan's); with `results`, write
    their figures as one results file, each run's figures prefixed by `label(path, meta)`."""
    t = Targets()
    runs = []
    for path in [paths] if isinstance(paths, Path) else paths:
        try:
            saved = json.loads(path.read_text())
            meta, pred, rounds = saved["meta"], saved["prediction"], saved["rounds"]
        except (OSError, ValueError, KeyError) as e:
            print(f"{benchmark}: --from-json {path}: not a saved run of this benchmark ({e})", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"{meta['layout']}: " + prediction_text(pred, meta["rate_mbit"]) + "\n")
        print(report_text(analyse(rounds, pred), pred, t, label(path, meta)))
        if saved.get("timeline"):
            print(timeline_text(saved["timeline"]))
        print(f"\n{meta['command']}; {meta['date']}; {meta['machine']}; load average before "
              f"{meta['load_before']}, after {meta['load_after']}")
        runs.append((path, meta))
    _results.write_saved(results, benchmark, "measurement", title, _results.figures_of(t), _plain(t.summary()), runs)


def from_json(paths: Path | list[Path], results: Path | None = None) -> None:
    """Re-print saved runs; with `results`, write their figures as one results file."""
    replay_saved(paths, results, "window_control", TITLE, lambda _, meta: f"{meta['layout']}: ")


def _plain(text: str) -> str:
    return text.replace("[green]", "").replace("[/green]", "").replace("[red]", "").replace("[/red]", "")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="tp2")
    ap.add_argument("--rate", type=float, default=400.0, help="link rate, Mbit/s (default 400; see the docstring)")
    ap.add_argument("--budget-frac", default="auto",
                    help="F in (0, 1]: budget per stage = full's peak + F x (none's - full's); auto: the F in "
                         "0.05..0.975 (step 0.025) with the largest predicted control - plan")
    ap.add_argument("--method", default="lynx", choices=("lynx", "lynx-heu"))
    ap.add_argument("--min-signal", type=float, default=0.04,
                    help="refuse when predicted control - plan is below this share of the predicted iteration")
    ap.add_argument("--iters", type=int, default=12, help="timed iterations per training run")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of A B A'")
    ap.add_argument("--repeats", type=int, default=5, help="profiler repeats")
    ap.add_argument("--smoke", action="store_true", help="2 iterations, 1 round, 2 profiler repeats")
    ap.add_argument("--out", type=Path, default=None, help="JSON of the run (default benchmarks/results/raw/"
                    "window_control_LAYOUT.json; with --smoke, none unless given)")
    ap.add_argument("--from-json", type=Path, nargs="+", default=None,
                    help="re-print the tables and targets of saved runs (with --results: write their figures)")
    _results.add_option(ap, "window_control")
    args = ap.parse_args()
    check_control_args(ap, args)
    if args.smoke:
        args.iters, args.rounds, args.repeats = 2, 1, 2
    if args.out is None and not args.smoke and args.from_json is None:
        args.out = Path(f"benchmarks/results/raw/window_control_{args.layout}.json")
    if args.from_json is None:
        pt.check_args(ap, args)
    return args


def measure(tb: Any, work: Path, paths: dict[str, Path], lay: Layout, iters: int, n_rounds: int
            ) -> tuple[list[dict[str, dict[str, Any]]], dict[str, Path]]:
    """`n_rounds` rounds of A B A', each a fresh training run; the last round's A and B also write their
    timeline when the runner can (PP > 1)."""
    rounds: list[dict[str, dict[str, Any]]] = []
    traces: dict[str, Path] = {}
    for k in range(n_rounds):
        rnd = {}
        for x in ROLES:
            tr = work / f"trace-{x}.json" if lay.pp > 1 and k == n_rounds - 1 and x != "A2" else None
            rnd[x] = run_summary(train(tb, paths[x], work / f"train-{k}-{x}.json", iters, lay.world, tr))
            if tr is not None:
                traces[x] = tr
        rounds.append(rnd)
        print(f"round {k + 1}/{n_rounds}: " + ", ".join(f"{x} {rnd[x]['median_s']:.3f} s" for x in ROLES), flush=True)
    return rounds, traces


def timeline_text(lines: dict[str, dict[str, dict[str, float]]]) -> str:
    return "\n".join(
        f"timeline of the {'plan' if x == 'A' else 'control'} (last iteration; per stage: window + cool-down / on "
        "demand s, of it overlapping a collective s): " + ", ".join(
            f"{d['window']:.3f} + {d['cooldown']:.3f} / {d['on_demand']:.3f}, {d['overlap']:.3f}" for d in tl.values())
        for x, tl in lines.items())


def main() -> None:
    args = parse()
    if args.from_json is not None:
        from_json(args.from_json, args.results)
        return
    run = _results.Run()
    _repo_on_path()
    from tests.harness.testbed import Testbed

    prepared = pt.workdir("lynx-wctl-")
    if prepared is None:
        return
    work, model = prepared
    lay = LAYOUTS[args.layout]
    load_before = os.getloadavg()
    start = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with Testbed(args.rate) as tb:
        pid, db = pt.profile(tb, work, model, lay.tp, args.repeats)
        pred, plan, ctl = choose(model, pid, db, lay, args.rate, args.budget_frac, args.method)
        print(f"{args.layout}: " + prediction_text(pred, args.rate), flush=True)
        if pred["hidden_s"] < args.min_signal * pred["plan_s"]:
            print(f"window_control: predicted control - plan {pred['hidden_s']:+.3f} s is under --min-signal "
                  f"{args.min_signal:g} x {pred['plan_s']:.3f} s, too small to measure: change --budget-frac "
                  f"(or --rate)", file=sys.stderr)
            raise SystemExit(2)
        paths = {"A": work / "plan.json", "B": work / "control.json", "A2": work / "plan.json"}
        plan.save(paths["A"])
        ctl.save(paths["B"])
        rounds, traces = measure(tb, work, paths, lay, args.iters, args.rounds)
    load_after = os.getloadavg()
    lines = {x: timeline(tr) for x, tr in traces.items()}
    targets = Targets()
    print("\n" + report_text(analyse(rounds, pred), pred, targets, f"{args.layout}: "))
    run.write(args.results, "window_control", "measurement", TITLE, _results.figures_of(targets),
              _plain(targets.summary()))
    if lines:
        print(timeline_text(lines))
    meta = {"command": " ".join(sys.argv), "date": start, "layout": args.layout, "rate_mbit": args.rate,
            "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, {platform.node()}",
            "load_before": load_before, "load_after": load_after, "iters": args.iters, "rounds": args.rounds,
            "profile_id": pid, "workdir": str(work), "model": pt.MODEL_YAML}
    print(f"\nload average before {load_before}, after {load_after}; plans, train reports and timelines in {work}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "prediction": pred, "rounds": rounds, "timeline": lines},
                                       indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
