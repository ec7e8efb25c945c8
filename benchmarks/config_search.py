"""How fast `lynx plan --gpus N` searches, and whether its pick beats a published configuration.

    python benchmarks/config_search.py                            # the three search cases and the single plan
    python benchmarks/config_search.py --case llama3-70b-64       # fresh `lynx plan` process: <= 15 s
    python benchmarks/config_search.py --case llama3.1-405b-1024  # <= 20 s
    python benchmarks/config_search.py --case llama3.1-405b-16384 # <= 60 s
    python benchmarks/config_search.py --case gpt-175b-single     # one `lynx plan`, 8 x 8 H100: <= 0.5 s
    python benchmarks/config_search.py --case gpt3-175b-96        # lynx's pick vs Megatron's published run
    python benchmarks/config_search.py --case qwen3-235b-256 --no-one-process \
        --results benchmarks/results/config_search_moe.json       # an MoE search (EP, ETP): 60 s for reference

The three search cases run `python -m lynx plan --gpus N ... --json` as a fresh process, with its default processes
(`--jobs`: one per CPU, the search's and its workers), then again with `--jobs 1` beside it for the ratio (imports, the
search, the recipes and the JSON included) over the full space (CP at every length with each comm type, every VPP,
Megatron's splits, every method, production overlaps) and time it from outside; they print candidates considered,
pruned, planned (and of those simulated), the process's wall and CPU time, the targets and whether they hold (exit
1 when one does not). On a shared machine the wall time counts the other tenants too: the CPU time is the figure to
compare. `--exhaustive` (in process) also plans every candidate the memory bound keeps and checks it picks the same
configuration. `--against REF` runs each search case once more with `--jobs 1` from this tree and from the git ref's
`src` at the same time, one per core, and records the ratio of their CPU times: on a VM whose speed drifts, the
change's own figure. A fixed pure-Python loop is timed before and after the cases: the machine's speed beside them.

The published case is Megatron-LM's strong-scaling GPT-3 run on H100 (README, "Strong Scaling
Results": GPT-3 175B with a 131,072-token vocabulary, sequence 4096, batch 1152 sequences, 96 GPUs at 47%
MFU; TP 4, PP 8 as the README's table and NVIDIA's GPT-3 recipe give it, so DP 3). Its layout is priced with
every stock Megatron-Core recompute flag beside the search's pick; the search keeps the published micro-batch
(1) and schedule (1F1B) and searches TP, PP, DP, SP, optimizer sharding and method (with 1,152 sequences the
free micro-batch and VPP dimensions take this machine over ten minutes).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import _results

from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.search import Pins, SearchResult, Space, search
from lynx.spec import load_hardware

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Case:
    model: str
    gpus: int
    global_batch: int
    seq_len: int
    planned_at_least: int
    seconds_at_most: float
    published: Pins | None = None
    published_mfu: float = 0.0
    pins: Pins = field(default_factory=Pins)


"""The fresh-process cases' figures, written to benchmarks/results/config_search.json."""

SINGLE_SECONDS = 0.5
"""`lynx plan` for GPT-175B on 8 x 8 H100 (issue 19's single-plan target, process start excluded)."""

CASES = {
    "llama3-70b-64": Case("llama3-70b", 64, 128, 8192, 0, 15.0),
    "llama3.1-405b-1024": Case("llama3.1-405b", 1024, 2048, 8192, 0, 20.0),
    "llama3.1-405b-16384": Case("llama3.1-405b", 16384, 2048, 8192, 0, 60.0),
    # a mixture-of-experts search (EP and ETP too) as a new user types it; no issue sets its target: 60 s, the
    # largest of issue 30's, for reference (`--case qwen3-235b-256 --results benchmarks/results/config_search_moe.json`)
    "qwen3-235b-256": Case("qwen3-235b-a22b", 256, 512, 4096, 0, 60.0),
    # DeepSeek-V3 as a new user types it (7.4M candidates): the search stops at its default time limit (600 s,
    # `--search-time-limit`) and says how far its pick can be from what it left; no issue sets a target: 660 s (the
    # limit, then the finalists' refinement and the recipes) for reference (`--case deepseek-v3-1024 --no-one-process
    # --case-timeout 1200 --results benchmarks/results/config_search_deepseek.json`)
    "deepseek-v3-1024": Case("deepseek-v3", 1024, 8192, 4096, 0, 660.0),
    "gpt3-175b-96": Case(str(HERE / "models" / "gpt3-175b-megatron.yaml"), 96, 1152, 4096, 0, 600.0,
                         published=Pins(tp=4, pp=8, vpp=1, mb=1, sp=True, dist_opt=True), published_mfu=0.47,
                         pins=Pins(mb=1, vpp=1)),
}


def _line(res: SearchResult) -> str:
    return (f"considered {res.considered}, pruned {res.pruned} (memory bound {res.over_memory_bound}, "
            f"time bound {res.count('pruned (time bound)')}), planned {res.planned} "
            f"({res.simulated} simulated, {res.count('planned')} fit), invalid {res.count('invalid')}; "
            f"{res.seconds:.1f} s; "
            f"{res.stage_problems} stage problems solved, {res.stage_hits} reused")


def _published(case: Case, space: Space, opts: PlanOptions, res: SearchResult) -> bool:
    assert case.published is not None
    pub = search(Space(space.model, space.hardware, space.gpus, space.global_batch, space.seq_len,
                       Pins(**{**_pins(case.published), "methods": None})), opts, top=50, exhaustive=True)
    stock = pub.best_stock
    best = res.best
    if stock is None or best is None:
        print(f"published layout: {'no stock flag fits' if stock is None else 'ok'}; pick: {best}")
        return False
    print(f"published layout {stock.candidate.layout.label()} ({stock.candidate.method}): predicted "
          f"{stock.iteration_s:.2f} s, MFU {stock.mfu:.1%} (measured {case.published_mfu:.0%})")
    print(f"lynx's pick     {best.candidate.layout.label()} ({best.candidate.method}): predicted "
          f"{best.iteration_s:.2f} s, MFU {best.mfu:.1%}")
    holds = best.iteration_s <= stock.iteration_s
    print(f"target: pick predicted at least as fast as the published configuration: "
          f"{'holds' if holds else 'DOES NOT HOLD'} ({stock.iteration_s / best.iteration_s - 1:+.1%})")
    return holds


def _single() -> bool:
    """`lynx plan --model gpt-175b --hardware h100-80g-nvlink --tp 8 --pp 8 --dp 1 --micro-batch 1
    --global-batch 64 --seq-len 2048 --nodes 8`, in process: lynx's own search time (partition, HEU, the
    simulator-judged refinement) and the final simulation with its Gantt segments, as the CLI runs them."""
    from lynx.api import make_problem, plan
    from lynx.spec import ParallelSpec

    par = ParallelSpec(tp=8, pp=8, dp=1, micro_batch_size=1, global_batch_size=64, seq_length=2048)
    problem = make_problem(load_model("gpt-175b"), load_hardware("h100-80g-nvlink"), par, PlanOptions(nodes=8))
    t0, c0 = time.perf_counter(), time.process_time()
    p = plan(problem, "lynx")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"gpt-175b 8 x 8 H100, lynx: iteration {p.sim.iteration_time_s:.3f} s; lynx's search "
          f"{p.result.search_time_s:.3f} s, plan + simulation {wall:.3f} s wall, {cpu:.3f} s CPU "
          "(process start and imports excluded)")
    holds = wall <= SINGLE_SECONDS
    FIGURES.append(_results.Figure("gpt-175b, 8 x 8 H100: one lynx plan", round(wall, 3), "s", f"<= {SINGLE_SECONDS}",
                                   holds))
    print(f"target: one plan <= {SINGLE_SECONDS} s: {'holds' if holds else 'DOES NOT HOLD'} ({wall:.3f} s)")
    return holds


FIGURES: list[_results.Figure] = []
"""Each case's time and target, for `--results`."""


def _pins(p: Pins) -> dict[str, object]:
    return {f: getattr(p, f) for f in ("tp", "pp", "vpp", "sp", "mb", "dist_opt")}


def _fresh(name: str, case: Case, hardware: str, precision: str, offload: bool, timeout_s: float,
           one_process: bool = True, against: tuple[str, Path] | None = None) -> bool:
    """`lynx plan --gpus N --json` in a fresh process, timed from outside (stopped after `timeout_s`), with its
    default workers; `one_process`: then again with `--jobs 1` beside it (the same pick; the ratio of the two)."""
    cmd = [sys.executable, "-m", "lynx", "plan", "--model", case.model, "--hardware", hardware, "--gpus",
           str(case.gpus), "--global-batch", str(case.global_batch), "--seq-len", str(case.seq_len), "--precision",
           precision, "--json", *([] if offload else ["--no-offload"])]
    ok = _fresh_once(name, case, cmd, timeout_s, target=True)
    if one_process:
        _fresh_once(name, case, [*cmd, "--jobs", "1"], timeout_s, target=False)
    if against is not None:
        _side_by_side(name, [*cmd, "--jobs", "1"], against, timeout_s)
    return ok


CPU_WRAP = ("import atexit, resource, sys\n"
            "atexit.register(lambda: print('cpu-seconds', sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), "
            "file=sys.stderr))\n"
            "sys.argv = ['lynx', *sys.argv[1:]]\n"
            "from lynx.cli import main\n"
            "main()\n")
"""`python -m lynx` that prints its own CPU time on stderr as it exits (one process: `--jobs 1`)."""


def _side_by_side(name: str, cmd: list[str], against: tuple[str, Path], timeout_s: float) -> None:
    """The same `--jobs 1` search from this tree's source and from `against` (a git ref's `src`), started together,
    one per core: both see the same machine, so the ratio of their CPU times is the change's, where either's
    figure alone moves with the machine's other tenants (a reference figure, no target)."""
    import json
    import subprocess

    ref, src = against
    here = Path(__file__).resolve().parent.parent / "src"
    args = cmd[cmd.index("plan"):]
    print(f"{name}: side by side with {ref} (--jobs 1 each, started together); load average "
          f"{os.getloadavg()[0]:.2f}")
    procs = [subprocess.Popen([sys.executable, "-c", CPU_WRAP, *args], env={**os.environ, "PYTHONPATH": str(path)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for path in (here, src)]
    cpu, picks = [], []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            print(f"  stopped after {timeout_s:.0f} s (--case-timeout): no ratio")
            return
        line = [x for x in err.splitlines() if x.startswith("cpu-seconds ")]
        if p.returncode not in (0, 3) or not line or "{" not in out:
            print(f"  failed ({p.returncode}): {err.strip().splitlines()[-1:]}")
            return
        cpu.append(float(line[-1].split()[1]))
        w = json.loads(out[out.index("{"):]).get("winner") or {}
        picks.append(tuple(w.get(k) for k in ("tp", "cp", "pp", "vpp", "dp", "method", "iteration_s")))
    same = "the same pick" if picks[0] == picks[1] else f"DIFFERENT picks {picks[0]} / {picks[1]}"
    print(f"  CPU: this tree {cpu[0]:.1f} s, {ref} {cpu[1]:.1f} s: ratio {cpu[0] / cpu[1]:.3f} ({same})")
    FIGURES.append(_results.Figure(f"{name}: CPU of this tree's --jobs 1 search over {ref}'s, run side by side "
                                   f"({cpu[0]:.1f} s / {cpu[1]:.1f} s; {same})", round(cpu[0] / cpu[1], 3), "x"))


REFERENCE_LOOP = 20_000_000
"""Iterations of the pure-Python loop timed before and after the cases (`_reference_loop`)."""


def _reference_loop() -> float:
    """Seconds one core takes for a fixed pure-Python loop (an integer sum over `REFERENCE_LOOP` values): the
    machine's speed when the cases ran, beside their times (a shared VM's speed drifts as its neighbours come and
    go: compare times taken at the same loop time, or side by side with `--against`)."""
    t0 = time.perf_counter()
    total = 0
    for i in range(REFERENCE_LOOP):
        total += i
    assert total == REFERENCE_LOOP * (REFERENCE_LOOP - 1) // 2
    return time.perf_counter() - t0


def _is_commit(ref: str) -> bool:
    import subprocess

    root = Path(__file__).resolve().parent.parent
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                          capture_output=True, check=False).returncode == 0


def _checkout_src(ref: str, into: Path) -> Path:
    """`git archive REF src` unpacked into `into`: the ref's package source."""
    import io
    import subprocess
    import tarfile

    root = Path(__file__).resolve().parent.parent
    data = subprocess.run(["git", "-C", str(root), "archive", ref, "src"], capture_output=True, check=False)
    if data.returncode != 0:
        print(f"{Path(sys.argv[0]).name}: error: --against {ref}: "
              f"{data.stderr.decode().strip() or 'git archive failed'}", file=sys.stderr)
        raise SystemExit(2)
    with tarfile.open(fileobj=io.BytesIO(data.stdout)) as t:
        t.extractall(into, filter="data")
    return into / "src"


def _fresh_once(name: str, case: Case, cmd: list[str], timeout_s: float, target: bool) -> bool:
    import json
    import resource
    import subprocess

    print(f"{name}: {' '.join(cmd[1:])}; load average {os.getloadavg()[0]:.2f} (2-core VM, shared)")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"  stopped after {timeout_s:.0f} s (--case-timeout): no pick")
        FIGURES.append(_results.Figure(f"{name}: fresh `lynx plan --gpus` (stopped at --case-timeout, no pick)",
                                       f"> {timeout_s:.0f}", "s", f"<= {case.seconds_at_most:.0f}", False))
        return False
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode not in (0, 3):
        print(f"  failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        return False
    d = json.loads(done.stdout[done.stdout.index("{"):])
    print(f"  considered {d['considered']}, pruned {d['pruned']} ({d['skipped_unbuilt']} never built), planned "
          f"{d['planned']} ({d['simulated']} simulated); search {d['seconds']:.1f} s in process; {d['jobs']} "
          f"process(es) ({d['jobs'] - 1} workers), {d['planned_ahead']['used']} of "
          f"{d['planned_ahead']['handed_out']} candidates handed out used")
    w = d["winner"]
    if w:
        print(f"  pick: TP{w['tp']} CP{w['cp']} PP{w['pp']} VPP{w['vpp']} DP{w['dp']} mb{w['micro_batch']} "
              f"{w['method']}: {w['iteration_s']:.3f} s")
    if d.get("stopped_at_time_limit"):
        found = d["fastest_in_lynx_pricing_s"]
        print(f"  stopped at the search's time limit ({d['time_limit_s']:g} s): {d['not_planned']} candidates not "
              f"planned, none faster than {d['open_bound_s']:.3f} s (their bound) in lynx's pricing")
        if target and found is not None:
            FIGURES.append(_results.Figure(
                f"{name}: stopped at the time limit ({d['time_limit_s']:g} s) with {d['not_planned']} candidates "
                f"not planned, their smallest bound {d['open_bound_s']:.3f} s; the fastest planned in lynx's pricing "
                f"{found:.3f} s is at most this much slower than the best of them", round(100 * (found /
                                                                                             d['open_bound_s'] - 1),
                                                                                        1), "%"))
    pick = f"; pick TP{w['tp']} CP{w['cp']} PP{w['pp']} VPP{w['vpp']} DP{w['dp']} {w['method']}" if w else ""
    if not target:
        FIGURES.append(_results.Figure(f"{name}: the same with --jobs 1 ({d['planned']} planned, {cpu:.1f} s "
                                       f"CPU{pick})", round(wall, 1), "s"))
        print(f"  one process: {wall:.1f} s wall, {cpu:.1f} s CPU (reference, no target)")
        return True
    holds = wall <= case.seconds_at_most
    FIGURES.append(_results.Figure(f"{name}: fresh `lynx plan --gpus` (--jobs {d['jobs']}; {d['planned']} planned, "
                                   f"{cpu:.1f} s CPU of every process{pick})",
                                   round(wall, 1), "s", f"<= {case.seconds_at_most:.0f}", holds))
    print(f"  target: fresh process <= {case.seconds_at_most:.0f} s: {'holds' if holds else 'DOES NOT HOLD'} "
          f"({wall:.1f} s wall, {cpu:.1f} s CPU of every process; wall counts the machine's other tenants)")
    return holds


def _run(name: str, hardware: str, precision: str, exhaustive: bool, offload: bool = True,
         timeout_s: float = 900.0, one_process: bool = True, against: tuple[str, Path] | None = None) -> bool:
    if name == "gpt-175b-single":
        print(f"{name}: load average {os.getloadavg()[0]:.2f} (2-core VM, shared)")
        return _single()
    case = CASES[name]
    if case.published is None and not exhaustive:
        return _fresh(name, case, hardware, precision, offload, timeout_s, one_process, against)
    hw = load_hardware(hardware)
    # as `lynx plan --gpus`: the offloading methods too when the hardware has a host link (--no-offload: not)
    space = Space(load_model(case.model), hw, case.gpus, case.global_batch, case.seq_len, case.pins,
                  offload=offload and hw.host() is not None)
    opts = PlanOptions(precision=precision)  # type: ignore[arg-type]
    print(f"{name}: {case.gpus} x {hardware}, batch {case.global_batch}, seq {case.seq_len}, offloading "
          f"{'on' if space.offload else 'off'}; "
          f"load average {os.getloadavg()[0]:.2f} (2-core VM, shared)")
    t0, c0 = time.perf_counter(), time.process_time()
    res = search(space, opts)
    wall = time.perf_counter() - t0
    print(_line(res) + f"; CPU {time.process_time() - c0:.1f} s of this process (wall time counts the machine's "
          "other tenants too)")
    if res.best is not None:
        b = res.best
        print(f"pick: {b.candidate.layout.label()} {b.candidate.method}: {b.iteration_s:.2f} s, MFU {b.mfu:.1%}, "
              f"peak {max(b.stage_peak_gib):.1f} GiB")
    holds = wall <= case.seconds_at_most and res.planned >= case.planned_at_least
    FIGURES.append(_results.Figure(f"{name}: search ({res.planned} planned"
                                   + (f"; pick {res.best.candidate.layout.label()} {res.best.candidate.method} "
                                      f"{res.best.iteration_s:.2f} s)" if res.best else ")"), round(wall, 1), "s",
                                   f"<= {case.seconds_at_most:.0f}" + (f" with >= {case.planned_at_least} planned"
                                                                       if case.planned_at_least else ""), holds))
    what = f">= {case.planned_at_least} candidates planned in " if case.planned_at_least else "the search in "
    print(f"target: {what}<= {case.seconds_at_most:.0f} s: {'holds' if holds else 'DOES NOT HOLD'} "
          f"({res.planned} planned, {res.simulated} of them simulated, in {wall:.1f} s)")
    ok = holds
    if case.planned_at_least:
        print(f"  planned = partition + per-stage policy (Lynx-HEU, or Megatron's flag), then the event simulation; "
              f"{res.planned - res.simulated} were decided before it, exactly: no policy fits, or the policy's "
              "held activations already exceed the budget (the simulated peak includes them)")
    if exhaustive:
        t0, c0 = time.perf_counter(), time.process_time()
        full = search(space, opts, exhaustive=True)
        wall = time.perf_counter() - t0
        print("exhaustive: " + _line(full) + f"; CPU {time.process_time() - c0:.1f} s")
        same = full.best is not None and res.best is not None and full.best.candidate == res.best.candidate \
            and full.best.iteration_s == res.best.iteration_s
        print(f"exhaustive pick equals the pruned search's: {'yes' if same else 'NO'}; of the {full.considered} "
              f"candidates {full.simulated} reach the simulator at all (the rest are over budget before it)")
        ok &= same
    if case.published is not None:
        ok &= _published(case, space, opts, res)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=[*sorted(CASES), "gpt-175b-single", "all"], default="all",
                    help="all: llama3-70b-64, llama3.1-405b-1024, llama3.1-405b-16384 and gpt-175b-single")
    ap.add_argument("--hardware", default="h100-80g-nvlink")
    ap.add_argument("--precision", default="megatron-bf16")
    ap.add_argument("--exhaustive", action="store_true",
                    help="also plan every candidate the memory bound keeps (the planned-per-30-s target)")
    ap.add_argument("--no-offload", action="store_true",
                    help="search without the offloading methods (lynx plan --gpus --no-offload)")
    ap.add_argument("--no-one-process", action="store_true",
                    help="skip the reference run of each fresh-process case with --jobs 1")
    ap.add_argument("--case-timeout", type=float, default=900.0, metavar="S",
                    help="stop a fresh-process search case after S seconds and record it as not holding (default 900)")
    ap.add_argument("--against", metavar="REF",
                    help="also run each fresh-process case with --jobs 1 from this tree and from the git ref REF's "
                         "source side by side, and record the ratio of their CPU times")
    _results.add_option(ap, "config_search")
    args = ap.parse_args()
    if not args.case_timeout > 0:
        ap.error(f"--case-timeout {args.case_timeout:g}: must be positive")
    if args.against is not None and not _is_commit(args.against):
        ap.error(f"--against {args.against}: not a commit of this repository (give a commit, tag or branch)")
    run = _results.Run()
    names = (["llama3-70b-64", "llama3.1-405b-1024", "llama3.1-405b-16384", "gpt-175b-single"]
             if args.case == "all" else [args.case])
    ok = True
    before = _reference_loop()
    print(f"machine speed: a {REFERENCE_LOOP:,}-step pure-Python loop took {before:.2f} s")
    with tempfile.TemporaryDirectory(prefix="lynx-against-") as tmp:
        against = None if args.against is None else (args.against, _checkout_src(args.against, Path(tmp)))
        for name in names:
            ok &= _run(name, args.hardware, args.precision, args.exhaustive, not args.no_offload, args.case_timeout,
                       not args.no_one_process, against)
    after = _reference_loop()
    print(f"machine speed after: {after:.2f} s for the same loop")
    FIGURES.append(_results.Figure(f"machine speed: a {REFERENCE_LOOP:,}-step pure-Python loop, before the cases "
                                   f"(after them: {after:.2f} s); the search's times scale with it", round(before, 2),
                                   "s"))
    # the record is named after its file: config_search.json (the cases of "all"), config_search_moe.json, ...
    name = args.results.stem if args.results is not None else "config_search"
    run.write(args.results, name, "measurement", "The configuration search, `lynx plan --gpus N`: speed and picks"
              + ("" if args.case == "all" else f" ({args.case})"), FIGURES)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
