"""`lynx train` with PP > 1: a plan runs and reports per stage what it held against the prediction, the
timeline is a Chrome trace beside the simulator's; a layout that does not match the world is refused before
any process group; a dead rank, a frozen rank and a cut link make the others fail within the timeout,
naming the peer, and nothing hangs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from lynx.api import make_problem  # noqa: E402
from lynx.methods import get_method  # noqa: E402
from lynx.models import load_model
from lynx.plan import Plan  # noqa: E402
from lynx.problem import PlanOptions  # noqa: E402
from lynx.spec import ParallelSpec, load_hardware
from tests.harness.train_probes import probe_command, probe_env


def write_plan(path: Path, method: str, tp: int = 1, pp: int = 2, dp: int = 1) -> Path:
    par = ParallelSpec(tp=tp, pp=pp, dp=dp, micro_batch_size=2, global_batch_size=4 * dp, seq_length=32)
    prob = make_problem(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), par, PlanOptions())
    Plan.evaluate(prob, get_method(method).fn(prob)).save(path)
    return path


def _train(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lynx.runtime.train", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_pp2_dp2_reports_stages_and_writes_a_trace_beside_the_simulator(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", "full", dp=2)
    out, trace = tmp_path / "r.json", tmp_path / "t.json"
    p = _train("--plan", str(plan), "--iters", "1", "--warmup", "0", "--threads", "1", "--out", str(out),
               "--trace", str(trace), "--compare-trace")
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert (r["pp"], r["dp"]) == (2, 2) and r["iterations"][0]["loss"] > 0
    assert len(r["iterations"][0]["time_s_per_rank"]) == 4
    for s in ("0", "1"):
        st = r["stages"][s]
        assert st["measured_act_after_fwd_bytes"] == st["predicted_act_after_fwd_bytes"]
        assert 0 < st["measured_act_peak_bytes"] <= st["predicted_act_peak_bytes"]
        assert st["restored"]["on_demand"] > 0
    assert (r["stages"]["0"]["in_flight"], r["stages"]["1"]["in_flight"]) == (2, 1)
    t = json.loads(trace.read_text())
    names = [e["name"] for e in t["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in t["traceEvents"]} == {0, 1, 2, 3}
    assert sum(n.startswith("F") for n in names) == sum(n.startswith("B") for n in names) == 4 * 2
    assert any(n.startswith("p2p wait") for n in names) and any(n.startswith("recompute") for n in names)
    assert all(e["dur"] >= 0 and e["ts"] >= -1e3 for e in t["traceEvents"] if e["ph"] == "X")
    assert "F meas" in p.stdout and "simulated" in p.stdout
    both = tmp_path / "both.json"
    q = subprocess.run([sys.executable, "-m", "lynx.runtime.trace", "compare", "--plan", str(plan), "--trace",
                        str(trace), "--out", str(both)], capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr
    assert any(e.get("pid") == 1000 for e in json.loads(both.read_text())["traceEvents"])


def test_host_staged_p2p_trains_as_the_direct_one(tmp_path: Path) -> None:
    """The p2p path of `--device cuda --backend gloo` (PipelineStages on the host, each stage's activation
    copied in and out) run on the CPU with the hidden `--host-staged`: the same losses bit for bit."""
    plan = write_plan(tmp_path / "plan.json", "lynx")
    losses = {}
    for mode in ("direct", "host"):
        out = tmp_path / f"{mode}.json"
        extra = ["--host-staged"] if mode == "host" else []
        p = _train("--plan", str(plan), "--iters", "2", "--warmup", "0", "--threads", "1", "--quiet",
                   "--backend", "gloo", "--out", str(out), *extra)
        assert p.returncode == 0, p.stderr[-2000:]
        r = json.loads(out.read_text())
        assert (r["backend"], r["p2p"]) == ("gloo", "host memory" if mode == "host" else "direct")
        losses[mode] = [it["loss"] for it in r["iterations"]]
    assert losses["host"] == losses["direct"], losses


def test_layout_not_matching_the_world_is_refused_before_any_process_group(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", "none", tp=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    t0 = time.monotonic()
    p = _train("--plan", str(plan), "--timeout", "60", env=env, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "TP 2 x PP 2 x DP 1 = 4 ranks, but 2 were started" in p.stderr
    assert time.monotonic() - t0 < 30  # no rendezvous was attempted (it would wait for rank 1)


def _two_ranks(plan: Path, probes: list[str], timeout: int) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            probe_command(probes, ["--plan", str(plan), "--iters", "3", "--threads", "1", "--timeout", str(timeout),
                                   "--quiet"]), env=probe_env(env), stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_dying_mid_iteration_fails_the_other_naming_it(tmp_path: Path, victim: int) -> None:
    plan = write_plan(tmp_path / "plan.json", "selective")
    procs = _two_ranks(plan, ["--die-at", "1", "--die-rank", str(victim)], timeout=20)
    t0 = time.monotonic()
    errs = [p.communicate(timeout=120)[1] for p in procs]
    other = 1 - victim
    assert procs[victim].returncode == 17
    assert procs[other].returncode == 1, errs[other][-2000:]
    assert f"rank {other}/2 failed" in errs[other] and f"(rank {victim})" in errs[other], errs[other][-2000:]
    assert time.monotonic() - t0 < 60


def test_a_frozen_rank_fails_the_other_within_the_timeout(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", "selective")
    timeout = 8
    procs = _two_ranks(plan, ["--freeze-at", "1", "--die-rank", "1"], timeout=timeout)
    t0 = time.monotonic()
    try:
        err = procs[0].communicate(timeout=120)[1]
        waited = time.monotonic() - t0
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 1, err[-2000:]
    assert "rank 0/2 failed" in err and "from stage 1 (rank 1)" in err and "Timed out" in err, err[-2000:]
    assert waited < timeout + 40  # start-up, one iteration, then the timeout


@pytest.mark.netns
def test_cut_pipeline_link_fails_both_stages_within_timeout(tmp_path: Path) -> None:
    from tests.harness.testbed import Testbed, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(f"testbed unavailable: {reason}")
    plan = write_plan(tmp_path / "plan.json", "selective")
    timeout = 8
    with Testbed(200) as tb:
        port = 20000 + (hash(str(tmp_path)) % 20000)
        argv = [sys.executable, "-m", "lynx.runtime.train", "--plan", str(plan), "--iters", "100000",
                "--warmup", "0", "--timeout", str(timeout), "--threads", "1"]
        procs = [tb.popen(r, argv, port) for r in (0, 1)]
        try:
            first = procs[0].stdout.readline()  # an iteration finished: the stages are talking
            assert first.startswith("iter"), first + procs[0].stderr.read()[-2000:]
            tb.cut_link()
            t0 = time.monotonic()
            errs = [p.communicate(timeout=timeout + 60)[1] for p in procs]
            waited = time.monotonic() - t0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert [p.returncode for p in procs] == [1, 1], [e[-1000:] for e in errs]
    assert "rank 0/2 failed" in errs[0] and "rank 1/2 failed" in errs[1]
    assert waited < timeout + 30


def test_the_runtime_executes_the_given_action_list(tmp_path: Path) -> None:
    """A GPipe order (all forwards, then all backwards) given as CSV is what every rank runs, in that order."""
    plan = write_plan(tmp_path / "plan.json", "selective")
    rows = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B1", "1B0"]]
    csv = tmp_path / "gpipe.csv"
    csv.write_text("\n".join(",".join(r) for r in rows) + "\n")
    trace = tmp_path / "t.json"
    p = _train("--plan", str(plan), "--iters", "1", "--warmup", "0", "--threads", "1", "--quiet",
               "--schedule", str(csv), "--trace", str(trace))
    assert p.returncode == 0, p.stderr[-2000:]
    events = json.loads(trace.read_text())["traceEvents"]
    for rank, row in enumerate(rows):
        ran = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e["cat"] == "pipeline"
               and e["name"][:1] in "FB"]
        ran.sort(key=lambda e: e["ts"])
        assert [f"{e['args']['stage']}{e['name'].split()[0]}" for e in ran] == row


def test_a_bad_action_list_is_one_line_and_exit_2(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", "none")
    csv = tmp_path / "bad.csv"
    csv.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1\n")
    p = _train("--plan", str(plan), "--schedule", str(csv), timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "micro-batch 1 of stage 1 needs one B" in p.stderr and len(p.stderr.strip().splitlines()) == 1
