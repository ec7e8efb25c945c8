"""The pipeline Model Deployer experiment on the namespace testbed. Needs root.

    python benchmarks/pipeline_testbed.py --layout pp2 --rate 100 --iters 10 --rounds 3 \\
        --out benchmarks/results/raw/pipeline_testbed_pp2.json
    python benchmarks/pipeline_testbed.py --layout pp2tp2 --rate 100 --iters 10 --rounds 3 \\
        --out benchmarks/results/raw/pipeline_testbed_pp2tp2.json

Layouts. `pp2`: PP = 2, TP = 1, stage r in namespace r on CPU r; the shaped link carries the pipeline's
activations and gradients (no TP collectives: the only place to hide recomputation is the cool-down stall).
`pp2tp2`: PP = 2 x TP = 2, four ranks; the two TP ranks of a stage sit in different namespaces, so every TP
collective crosses the shaped link, while both stages of a TP rank share its namespace and its one CPU
(the pipeline's p2p is local). Sharing a core means a stage's compute also waits for the other stage's.

For the layout: profile the layer (`lynx profile`, inside the testbed for TP = 2), pick a per-stage budget
halfway between full's and none's simulated peak (none does not fit), plan none, full, lynx-heu (dp
partition) and lynx, and derive the **window control** of every plan that recomputes in windows: the same
policy with every phase 1-4 moved to phase 5 and no cool-down overlap (same memory held after forward).
Then `--rounds` rounds, each training every plan once (interleaved). Per plan: measured iteration time
(min and median over all timed iterations) against the prediction, per-stage peak activation bytes
against the prediction, the engine's recomputation seconds per place (forward/backward windows, cool-down,
on demand) against the simulator's hidden/critical recomputation, and for each control the time it adds
(what the windows hid) beside the engine's window time and the predicted difference. The load average
before and after is recorded: the 2-core machine is shared, numbers from a busy machine are not results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _results
from _targets import Targets

MODEL_YAML = """name: testbed-gpt
num_layers: 4
hidden_size: 512
num_attention_heads: 8
vocab_size: 1024
max_position_embeddings: 512
"""
MB, SEQ, GB = 2, 256, 8
METHODS = ("none", "full", "lynx-heu", "lynx")
LAYOUTS = {"pp2": {"tp": 1, "pp": 2}, "pp2tp2": {"tp": 2, "pp": 2}}



def _repo_on_path() -> None:
    """The test harnesses (`tests.harness`) live beside the package, not in it: the repository root on the path."""
    import sys as _sys
    from pathlib import Path as _Path

    root = str(_Path(__file__).resolve().parents[1])
    if root not in _sys.path:
        _sys.path.insert(0, root)

def _ok(results, what: str) -> None:
    bad = [r for r in results if r.returncode != 0]
    if bad:
        raise SystemExit(f"{what} failed on rank {bad[0].rank}: {bad[0].stderr.strip()[-1500:]}")


def profile(tb, work: Path, model: Path, tp: int, repeats: int) -> tuple[int, Path]:
    shape = ["--tp", str(tp), "--micro-batch", str(MB), "--seq-len", str(SEQ), "--repeats", str(repeats),
             "--threads", "1"]  # as training runs: one thread per rank
    if tp == 1:  # no collective to shape: profile in place
        db = work / "profiles.sqlite"
        p = subprocess.run([sys.executable, "-m", "lynx", "profile", "--model", str(model), *shape, "--db", str(db),
                            "--json", "--device", "cpu"], capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"lynx profile: {p.stderr.strip()[-1500:]}")
        return int(json.loads(p.stdout)["id"]), db
    dbs = [work / f"profiles{r}.sqlite" for r in (0, 1)]
    argv = [[sys.executable, "-m", "lynx", "profile", "--model", str(model), *shape, "--db", str(dbs[r]), "--json"]
            for r in (0, 1)]
    res = tb.run(argv, timeout=900)
    _ok(res, "lynx profile")
    return int(json.loads(res[0].stdout)["id"]), dbs[0]


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Before any work (shared with window_control.py): a finite positive link rate, at least one iteration,
    round and profiler repeat, and a JSON `--out` whose directory exists (or can be made) and is writable."""
    import math

    from lynx.errors import LynxError
    from lynx.paths import check_output

    if not (math.isfinite(args.rate) and args.rate > 0):
        ap.error(f"--rate {args.rate}: expected a positive link rate in Mbit/s")
    for name in ("iters", "rounds", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be at least 1")
    if args.out is not None:
        try:
            if not args.out.parent.exists():
                args.out.parent.mkdir(parents=True)
            check_output(args.out, "--out", (".json",))
        except (OSError, LynxError) as e:
            ap.error(str(e))


def from_json_rows(ap: argparse.ArgumentParser, path: Path) -> dict:
    try:
        saved = json.loads(path.read_text())
        saved["rows"], saved["meta"]["command"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--from-json {path}: not a saved run of this benchmark ({e})")
    return saved


def workdir(prefix: str) -> tuple[Path, Path] | None:
    """A fresh work directory with the model's YAML in it, or None (and why, printed) without a testbed."""
    _repo_on_path()
    from tests.harness.testbed import unavailable

    reason = unavailable()
    if reason:
        print(f"skipped: {reason}")
        return None
    work = Path(tempfile.mkdtemp(prefix=prefix))
    model = work / "testbed-gpt.yaml"
    model.write_text(MODEL_YAML)
    return work, model


def testbed_hardware(tp: int, pp: int, rate_mbit: float):
    """The testbed as lynx hardware: the layer's times and TP collectives come from the profile; what the
    hardware adds is the pipeline's point-to-point link. With TP = 1 the stages sit in two namespaces and
    p2p crosses the shaped link; with TP 2 both stages of a TP rank share a namespace (loopback, ~free)."""
    from dataclasses import replace

    from lynx.spec import LinkSpec, load_hardware

    hw = load_hardware("a100-40g-nvlink")
    shaped = LinkSpec(bandwidth_Bps=rate_mbit * 1e6 / 8, latency_s=1e-4, efficiency=0.95)
    link = shaped if tp == 1 else hw.intra_node
    return replace(hw, name=f"testbed-{rate_mbit:g}mbit", devices_per_node=tp * pp, intra_group_size=tp * pp,
                   intra_node=link, inter_node=link, inter_group=None, topology=None)


def _problem(model: Path, pid: int, db: Path, tp: int, pp: int, rate: float, budget: float | None = None,
             gb: int = GB):
    from lynx.api import make_problem
    from lynx.models import load_model
    from lynx.problem import PlanOptions
    from lynx.profile.store import load_profile_graph
    from lynx.spec import ParallelSpec

    par = ParallelSpec(tp=tp, pp=pp, micro_batch_size=MB, global_batch_size=gb, seq_length=SEQ)
    return make_problem(load_model(str(model)), testbed_hardware(tp, pp, rate), par,
                        PlanOptions(budget_bytes=budget), graph=load_profile_graph(str(pid), db))


def choose_budget(model: Path, pid: int, db: Path, tp: int, pp: int, rate: float) -> tuple[float, dict[str, float]]:
    from lynx.methods import get_method
    from lynx.plan import Plan

    prob = _problem(model, pid, db, tp, pp, rate)
    peaks = {m: max(s.peak_memory_bytes for s in Plan.evaluate(prob, get_method(m).fn(prob)).sim.stages)
             for m in ("none", "full")}
    return peaks["full"] + 0.5 * (peaks["none"] - peaks["full"]), peaks


def make_plans(work: Path, model: Path, pid: int, db: Path, tp: int, pp: int, rate: float,
               budget: float) -> dict[str, Path]:
    """The four methods' plans and, for each that recomputes in a window or a stall, its window control."""
    from _window_control import save_control

    from lynx.methods import get_method
    from lynx.plan import Plan

    prob = _problem(model, pid, db, tp, pp, rate, budget)
    out: dict[str, Path] = {}
    for m in METHODS:
        res = get_method(m).fn(prob)
        out[m] = work / f"plan-{m}.json"
        Plan.evaluate(prob, res).save(out[m])
        if save_control(prob, res, work / f"plan-{m}-ondemand.json"):
            out[f"{m}/ondemand"] = work / f"plan-{m}-ondemand.json"
    return out


def train(tb, plan_path: Path, out: Path, iters: int, world: int, trace: Path | None) -> dict:
    argv = [sys.executable, "-m", "lynx.runtime.train", "--plan", str(plan_path), "--iters", str(iters),
            "--warmup", "1", "--out", str(out), "--quiet", "--timeout", "300", "--threads", "1"]
    if trace is not None:
        argv += ["--trace", str(trace)]
    res = tb.run(argv, timeout=1800, world=world)
    _ok(res, f"training {plan_path.name}")
    return json.loads(out.read_text())


def summarize(name: str, plan: dict, runs: list[dict]) -> dict:
    timed = [it for r in runs for it in r["iterations"] if not it["warmup"]]
    times = [it["time_s"] for it in timed]
    pred = plan["prediction"]
    stages = {}
    for s, st in runs[-1]["stages"].items():
        sim = pred["stages"][int(s)] if int(s) < len(pred["stages"]) else {}
        stages[s] = {
            "act_peak_meas": max(r["stages"][s]["measured_act_peak_bytes"] for r in runs),
            "act_peak_pred": st["predicted_act_peak_bytes"],
            "window_s": statistics.median(r["stages"][s]["window_s"] for r in runs),
            "cooldown_s": statistics.median(r["stages"][s]["cooldown_s"] for r in runs),  # part of window_s
            "ondemand_s": statistics.median(r["stages"][s]["ondemand_s"] for r in runs),
            "sim_hidden_s": sim.get("recompute_overlapped_s"), "sim_critical_s": sim.get("recompute_critical_s"),
            "restored": st["restored"]}
    return {"method": name, "fits": not pred["oom"], "min_s": min(times), "median_s": statistics.median(times),
            "predicted_s": pred["iteration_time_s"], "times": times, "stages": stages}


def table(rows: dict[str, dict]) -> str:
    mib = 2**20
    lines = ["| plan | fits | measured s (min / median) | predicted s | per stage act. peak MiB (meas / pred) "
             "| recompute s per stage: windows + cool-down / on demand (engine) | hidden / critical (sim) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        st = r["stages"].values()
        lines.append(
            f"| {name} | {'yes' if r['fits'] else 'no'} | {r['min_s']:.3f} / {r['median_s']:.3f} | "
            f"{r['predicted_s']:.4f} | "
            + ", ".join(f"{x['act_peak_meas'] / mib:.1f} / {x['act_peak_pred'] / mib:.1f}" for x in st) + " | "
            + ", ".join(f"{x['window_s']:.3f} / {x['ondemand_s']:.3f}" for x in st) + " | "
            + ", ".join(f"{(x['sim_hidden_s'] or 0):.4f} / {(x['sim_critical_s'] or 0):.4f}" for x in st) + " |")
    lines += ["", "| window control | Δ median s (control - plan) | engine window + cool-down s (plan, sum over "
              "stages) | predicted Δ s |", "|---|---|---|---|"]
    for name, r in rows.items():
        c = rows.get(f"{name}/ondemand")
        if c is None:
            continue
        win = sum(x["window_s"] for x in r["stages"].values())  # the engine's window_s includes the cool-down
        lines.append(f"| {name} | {c['median_s'] - r['median_s']:+.3f} | {win:.3f} | "
                     f"{c['predicted_s'] - r['predicted_s']:+.4f} |")
    return "\n".join(lines)


def targets(rows: dict[str, dict], t: Any = None) -> str:
    """The issue's targets, each checked: measured median within 10% of the predicted iteration time and every
    stage's activation peak within 5% (measured never above); lynx measurably faster than full (its slowest
    timed iteration below full's fastest); each window control's added time within 25% of the plan's
    recomputation of the predicted difference."""
    t = Targets() if t is None else t
    lines = ["| plan | time within 10% | act. peak within 5% (never above) | control within 25% of recompute |",
             "|---|---|---|---|"]
    for name, r in rows.items():
        time_ok = t.add(f"{name}: median iteration / predicted ({r['median_s']:.3f} s / {r['predicted_s']:.3f} s)",
                        abs(r["median_s"] / r["predicted_s"] - 1) <= 0.10, round(r["median_s"] / r["predicted_s"], 3),
                        "within 10% of 1")
        mem_ok = t.add(f"{name}: every stage's activation peak within 5% of predicted, never above",
                       all(x["act_peak_meas"] <= x["act_peak_pred"] * (1 + 1e-9)
                           and x["act_peak_meas"] >= 0.95 * x["act_peak_pred"] for x in r["stages"].values()))
        c = rows.get(f"{name}/ondemand")
        ctrl = "-"
        if c is not None:
            recompute = sum(x["window_s"] + x["ondemand_s"] for x in r["stages"].values())
            delta, pred = c["median_s"] - r["median_s"], c["predicted_s"] - r["predicted_s"]
            ctrl = t.add(f"{name}: time the control adds, s", recompute > 0 and abs(delta - pred) <= 0.25 * recompute,
                         round(delta, 3), f"predicted {pred:.3f} ± 0.25 x recomputation {recompute:.3f}")
        lines.append(f"| {name} | {time_ok} | {mem_ok} | {ctrl} |")
    if "lynx" in rows and "full" in rows:
        faster = max(rows["lynx"]["times"]) < min(rows["full"]["times"])
        lines.append(f"\nlynx measurably faster than full (every lynx iteration below full's fastest): "
                     f"{t.add('lynx faster than full', faster)}")
    return "\n".join(lines + ["", t.summary()]).replace("[green]", "").replace("[/green]", "").replace(
        "[red]", "").replace("[/red]", "")


TITLE = "The pipeline runtime on the namespace testbed: measured against predicted"


def _plain(text: str) -> str:
    return text.replace("[green]", "").replace("[/green]", "").replace("[red]", "").replace("[/red]", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="pp2")
    ap.add_argument("--rate", type=float, default=100.0, help="link rate, Mbit/s")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all plans and controls")
    ap.add_argument("--repeats", type=int, default=5, help="profiler repeats")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/raw/pipeline_testbed.json"))
    ap.add_argument("--from-json", type=Path, default=None,
                    help="re-print the tables of a saved run (with --results: write its figures)")
    _results.add_option(ap, "pipeline_testbed")
    args = ap.parse_args()
    run = _results.Run()
    t = Targets()
    if args.from_json is not None:
        saved = from_json_rows(ap, args.from_json)
        print(table(saved["rows"]) + "\n\n" + targets(saved["rows"], t))
        _results.write_saved(args.results, "pipeline_testbed", "measurement", TITLE, _results.figures_of(t),
                             _plain(t.summary()), [(args.from_json, saved["meta"])])
        print(f"\n{saved['meta']['command']}; {saved['meta']['date']}; load average before "
              f"{saved['meta']['load_before']}, after {saved['meta']['load_after']}")
        return
    check_args(ap, args)
    _repo_on_path()
    from tests.harness.testbed import Testbed

    prepared = workdir("lynx-pptestbed-")
    if prepared is None:
        return
    work, model = prepared
    lay = LAYOUTS[args.layout]
    world = lay["tp"] * lay["pp"]
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {}
    with Testbed(args.rate) as tb:
        pid, db = profile(tb, work, model, lay["tp"], args.repeats)
        budget, peaks = choose_budget(model, pid, db, lay["tp"], lay["pp"], args.rate)
        plans = make_plans(work, model, pid, db, lay["tp"], lay["pp"], args.rate, budget)
        for k in range(args.rounds):
            for name, path in plans.items():
                tag = name.replace("/", "-")
                trace = work / f"trace-{tag}.json" if k == args.rounds - 1 else None
                runs.setdefault(name, []).append(train(tb, path, work / f"train-{tag}-{k}.json", args.iters, world,
                                                       trace))
    load_after = os.getloadavg()
    rows = {n: summarize(n, json.loads(plans[n].read_text()), rs) for n, rs in runs.items()}
    print(table(rows) + "\n\n" + targets(rows, t))
    run.write(args.results, "pipeline_testbed", "measurement", TITLE, _results.figures_of(t), _plain(t.summary()))
    print(f"\nload average before {load_before}, after {load_after}; traces in {work} "
          f"(python -m lynx.runtime.trace compare --plan {work}/plan-lynx.json --trace {work}/trace-lynx.json)")
    meta = {"command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
            "load_before": load_before, "load_after": load_after, "layout": args.layout, "rate_mbit": args.rate,
            "model": MODEL_YAML, "shape": {"micro_batch": MB, "seq": SEQ, "global_batch": GB},
            "budget_bytes": budget, "simulated_peaks": peaks, "profile_id": pid, "workdir": str(work)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
