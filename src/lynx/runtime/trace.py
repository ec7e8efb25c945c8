"""Timelines: the measured one (Chrome-trace JSON, opens in Perfetto / chrome://tracing) and the
simulator's for the same plan, side by side, with per-stage differences.

A measured event is (category, name, t0, t1) in `time.perf_counter()` seconds of one rank; each rank's
events are shifted by its own iteration start (after a barrier), so ranks line up within the barrier's
skew. Categories: "pipeline" (F, B, p2p waits), "recompute" (each restored op, with its window),
"collective" (each TP collective's window and wait, the gradient all-reduces), "copy" (each offloaded storage's
copy to the host, "d2h", and back, "h2d": the host time to issue it; on the CPU the whole copy).

`python -m lynx.runtime.trace compare --plan plan.json --trace trace.json [--out both.json]` prints the
comparison and writes one trace with the measured ranks and the simulated stages as separate processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lynx.errors import LynxError
from lynx.paths import MAX_JSON_BYTES, check_output, read_text, write_text

Event = tuple[str, str, float, float, int]
"""(category, name, t0, t1, stage)."""
_TID = {"pipeline": 0, "recompute": 1, "collective": 2, "copy": 3, "sim": 0}


def chrome_events(rank: int, label: str, events: Iterable[Event], origin: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": label}},
        *({"ph": "M", "name": "thread_name", "pid": rank, "tid": t, "args": {"name": c}}
          for c, t in _TID.items() if c != "sim"),
    ]
    for cat, name, t0, t1, stage in events:
        out.append({"ph": "X", "pid": rank, "tid": _TID.get(cat, 4), "cat": cat, "name": name,
                    "ts": (t0 - origin) * 1e6, "dur": max(0.0, t1 - t0) * 1e6, "args": {"stage": stage}})
    return out


def write_chrome(path: str | Path, events: list[dict[str, Any]], meta: dict[str, Any] | None = None,
                 option: str = "--trace") -> None:
    """Written whole or not at all (a temporary file renamed into place)."""
    write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta or {}}),
               option, TraceError)


class TraceError(LynxError):
    """A trace file that is not lynx's, or not of the plan it is compared with."""


def read_trace(path: str | Path) -> dict[str, Any]:
    """A trace written by `lynx train --trace`: capped, parsed, and shaped as one (one line naming the file)."""
    text = read_text(path, "trace", MAX_JSON_BYTES, TraceError)
    try:
        trace = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise TraceError(f"{path}: not JSON ({e})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(f"{path}: not a Chrome trace (no traceEvents list); give a file from lynx train --trace")
    return trace


def check_trace_matches(trace: dict[str, Any], trace_path: str | Path, pp: int, vpp: int, microbatches: int) -> None:
    """The trace was measured on this plan's pipeline: its recorded layout (or, for older traces, the stages
    its events name) agrees with the plan's; a mismatch would compare two different runs silently."""
    layout = trace.get("otherData", {}).get("layout")
    if isinstance(layout, dict):
        got = (layout.get("pp"), layout.get("vpp"), layout.get("num_microbatches"))
        if got != (pp, vpp, microbatches):
            raise TraceError(f"{trace_path}: measured on PP {got[0]} x VPP {got[1]} with {got[2]} micro-batches; "
                             f"the plan has PP {pp} x VPP {vpp} with {microbatches}: compare a trace with its own plan")
        return
    stages = {e.get("args", {}).get("stage") for e in trace["traceEvents"] if e.get("ph") == "X"}
    bad = sorted(s for s in stages if isinstance(s, int) and not 0 <= s < pp * vpp)
    if bad:
        raise TraceError(f"{trace_path}: events of stage {bad[0]}, beyond the plan's {pp * vpp} stages")


def simulated_segments(
        plan_path: str | Path) -> tuple[float, list[tuple[int, str, int, float, float]], tuple[int, int, int]]:
    """The simulator's timeline for a plan: (iteration time, [(stage, kind, micro-batch, start, end)],
    (PP, VPP, micro-batches)).
    The one place that calls lynx.simulate here (kept to one call so the simulator's interface is used in one place)."""
    from lynx.plan import Plan, load_plan

    problem, result = load_plan(plan_path)
    sim = Plan.evaluate(problem, result, record=True).sim
    shape = (problem.parallel.pp, problem.options.vpp, problem.parallel.num_microbatches)
    return sim.iteration_time_s, [(s.stage, s.kind, s.microbatch, s.start, s.end) for s in sim.segments], shape


def _measured_by_stage(trace: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per stage from the measured trace (TP ranks of a stage summed, DP replicas too: divide by the
    ranks of the stage to compare with one simulated stage): F, B, p2p waits, recomputation per place,
    collective waits, and the number of ranks that ran the stage."""
    out: dict[int, dict[str, float]] = {}
    ranks: dict[int, set[int]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e["pid"] >= 1000 or e.get("args", {}).get("stage", -1) < 0:
            continue
        s, name, dur = e["args"]["stage"], e["name"], e["dur"] / 1e6
        ranks.setdefault(s, set()).add(e["pid"])
        d = out.setdefault(s, dict.fromkeys(("F", "B", "p2p_wait", "window", "cooldown", "on_demand",
                                             "collective_wait"), 0.0))
        if e["cat"] == "pipeline" and name[:1] in "FB":
            d[name[0]] += dur
        elif name.startswith("p2p wait"):
            d["p2p_wait"] += dur
        elif e["cat"] == "recompute":
            place = name.rsplit("(", 1)[1].rstrip(")")
            d[place if place in ("cooldown", "on_demand") else "window"] += dur
        elif name.startswith("wait "):
            d["collective_wait"] += dur
    for s, ov in _overlap(trace["traceEvents"]).items():
        out.setdefault(s, {})["overlap"] = ov
    for s, d in out.items():
        n = len(ranks.get(s, {0}))
        for k in d:
            d[k] /= n
    return out


def _overlap(events: list[dict[str, Any]]) -> dict[int, float]:
    """Per stage: seconds of recomputation that ran while a collective of the same rank was in flight (the
    intersection of each "recompute" event with that rank's "... window" collective events)."""
    wins: dict[int, list[tuple[float, float]]] = {}
    recs: list[tuple[int, int, float, float]] = []
    for e in events:
        if e.get("ph") != "X" or e["pid"] >= 1000:
            continue
        a, b = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        if e["cat"] == "collective" and e["name"].endswith(" window"):
            wins.setdefault(e["pid"], []).append((a, b))
        elif e["cat"] == "recompute":
            recs.append((e["pid"], e.get("args", {}).get("stage", -1), a, b))
    out: dict[int, float] = {}
    for pid, stage, a, b in recs:
        hit = sum(max(0.0, min(b, y) - max(a, x)) for x, y in wins.get(pid, ()))
        out[stage] = out.get(stage, 0.0) + min(hit, b - a)
    return out


def compare(plan_path: str | Path, trace_path: str | Path) -> tuple[list[str], list[dict[str, Any]]]:
    """Report lines (per stage: measured vs simulated forward, backward, hidden and exposed recomputation,
    stalls, and the measured seconds of recomputation that overlapped a collective in flight) and the
    simulated stages as Chrome events (pids 1000 + stage)."""
    trace = read_trace(trace_path)
    t_sim, segs, (pp, vpp, mbs) = simulated_segments(plan_path)
    check_trace_matches(trace, trace_path, pp, vpp, mbs)
    if not any(isinstance(e, dict) and e.get("ph") == "X" for e in trace["traceEvents"]):
        raise TraceError(f"{trace_path}: a Chrome trace with no events (no complete \"X\" event) has nothing to "
                         "compare; give a file from lynx train --trace of a PP > 1 run")
    meas = _measured_by_stage(trace)
    sim: dict[int, dict[str, float]] = {}
    events: list[dict[str, Any]] = []
    for s, kind, mb, a, b in segs:
        d = sim.setdefault(s, {"F": 0.0, "B": 0.0, "recompute": 0.0, "overlap": 0.0, "stall": 0.0})
        d[kind] = d.get(kind, 0.0) + (b - a)
        if not any(ev.get("pid") == 1000 + s and ev.get("ph") == "M" for ev in events):
            events.append({"ph": "M", "name": "process_name", "pid": 1000 + s,
                           "args": {"name": f"simulated stage {s}"}})
        events.append({"ph": "X", "pid": 1000 + s, "tid": 0, "cat": "sim", "name": f"{kind}{mb}",
                       "ts": a * 1e6, "dur": (b - a) * 1e6})
    lines = [f"iteration: measured {trace.get('otherData', {}).get('iteration_time_s', float('nan')):.4f} s, "
             f"simulated {t_sim:.4f} s (on the plan's hardware)",
             f"{'stage':>5} {'F meas':>9} {'F sim':>9} {'B meas':>9} {'B sim':>9} {'hidden meas':>12} "
             f"{'hidden sim':>11} {'exposed meas':>13} {'exposed sim':>12} {'p2p wait':>9} {'stall sim':>10}"]
    for s in sorted(set(meas) | set(sim)):
        m, q = meas.get(s, {}), sim.get(s, {})
        lines.append(f"{s:>5} {m.get('F', 0):9.4f} {q.get('F', 0):9.4f} {m.get('B', 0):9.4f} "
                     f"{q.get('B', 0) + q.get('recompute', 0):9.4f} {m.get('window', 0) + m.get('cooldown', 0):12.4f} "
                     f"{q.get('overlap', 0):11.4f} {m.get('on_demand', 0):13.4f} {q.get('recompute', 0):12.4f} "
                     f"{m.get('p2p_wait', 0):9.4f} {q.get('stall', 0):10.4f} {m.get('overlap', 0):9.4f}")
    return lines, events


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lynx.runtime.trace")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="measured timeline beside the simulator's, per stage")
    c.add_argument("--plan", required=True)
    c.add_argument("--trace", required=True, help="a trace written by lynx train --trace")
    c.add_argument("--out", default=None, help="write measured + simulated timelines as one Chrome trace")
    a = p.parse_args(argv)
    try:
        check_output(a.out, "--out", (".json",), TraceError)  # before any work; None passes
        lines, sim_events = compare(a.plan, a.trace)
        if a.out:  # the file first: a reader that leaves the printout early (| head) must not lose it
            trace = read_trace(a.trace)
            write_chrome(a.out, trace["traceEvents"] + sim_events, trace.get("otherData"), "--out")
        print("\n".join(lines), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except LynxError as e:
        print(f"lynx trace: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except (KeyError, TypeError, ValueError) as e:  # events of another program's trace
        print(f"lynx trace: error: {a.trace}: not a lynx trace ({type(e).__name__}: {e})", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
