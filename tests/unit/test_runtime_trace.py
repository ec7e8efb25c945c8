"""The trace tools: measured recomputation overlapping a collective window, per stage; compare's bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lynx.runtime import trace


def _x(pid: int, cat: str, name: str, ts: float, dur: float, stage: int) -> dict:
    return {"ph": "X", "pid": pid, "tid": 0, "cat": cat, "name": name, "ts": ts * 1e6, "dur": dur * 1e6,
            "args": {"stage": stage}}


def test_overlap_is_the_intersection_with_the_ranks_own_collective_windows() -> None:
    events = [
        _x(0, "collective", "allreduce window", 1.0, 1.0, 0),     # [1, 2)
        _x(0, "recompute", "recompute ln2 L0 mb0 (fwd_mlp)", 1.5, 1.0, 0),   # [1.5, 2.5): 0.5 inside
        _x(0, "recompute", "recompute fc1 L0 mb0 (on_demand)", 3.0, 0.5, 0),  # outside any window
        _x(1, "recompute", "recompute ln2 L1 mb0 (fwd_mlp)", 1.0, 1.0, 1),   # rank 1 has no window
        _x(0, "collective", "wait allreduce", 2.0, 0.2, 0),        # a wait is not a window
    ]
    got = trace._overlap(events)
    assert abs(got[0] - 0.5) < 1e-9 and got[1] == 0.0


def test_chrome_events_are_complete_events_with_stage(tmp_path: Path) -> None:
    evs = trace.chrome_events(3, "rank 3", [("pipeline", "F0 stage 1", 10.0, 10.5, 1)], origin=10.0)
    x = [e for e in evs if e["ph"] == "X"]
    assert x == [{"ph": "X", "pid": 3, "tid": 0, "cat": "pipeline", "name": "F0 stage 1", "ts": 0.0,
                  "dur": 500000.0, "args": {"stage": 1}}]
    trace.write_chrome(tmp_path / "t.json", evs)
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"][0]["ph"] == "M"


def test_compare_refuses_missing_and_foreign_files(tmp_path: Path) -> None:
    def run(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lynx.runtime.trace", "compare", *a], capture_output=True,
                              text=True, timeout=60)

    p = run("--plan", str(tmp_path / "no.json"), "--trace", str(tmp_path / "no.json"))
    assert p.returncode == 2 and "no.json: no such" in p.stderr and "Traceback" not in p.stderr
    from lynx.api import make_problem
    from lynx.methods import get_method
    from lynx.models import load_model
    from lynx.plan import Plan
    from lynx.problem import PlanOptions
    from lynx.spec import ParallelSpec, load_hardware

    par = ParallelSpec(tp=1, pp=2, micro_batch_size=2, global_batch_size=4, seq_length=32)
    prob = make_problem(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), par, PlanOptions())
    Plan.evaluate(prob, get_method("full").fn(prob)).save(tmp_path / "plan.json")
    (tmp_path / "foreign.json").write_text(json.dumps({"events": []}))
    p = run("--plan", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "foreign.json"))
    assert p.returncode == 2 and "not a Chrome trace" in p.stderr and "Traceback" not in p.stderr
    # a trace of another layout (4 micro-batches recorded, the plan has 2): refused, naming both
    other = {"traceEvents": [], "otherData": {"layout": {"pp": 2, "vpp": 1, "num_microbatches": 4}}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    p = run("--plan", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "other.json"))
    assert p.returncode == 2 and "4 micro-batches" in p.stderr and "with 2" in p.stderr, p.stderr
    # --out is checked before any work, and nothing is written
    p = run("--plan", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "other.json"), "--out",
            str(tmp_path / "nodir" / "both.json"))
    assert p.returncode == 2 and "--out" in p.stderr and not (tmp_path / "nodir").exists()
    (tmp_path / "huge.json").write_text("[" + " " * (64 << 20) + "]")
    p = run("--plan", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "huge.json"))
    assert p.returncode == 2 and "larger than 64 MiB" in p.stderr
