"""The namespace testbed (needs root): a shaped link really leaves the CPU free during an all-reduce, and a
cut link makes both ranks fail with a clear message within the process-group timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.harness.testbed import Testbed, unavailable  # noqa: E402

REASON = unavailable()

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(REASON is not None, reason=f"testbed unavailable: {REASON}")]


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_compute_overlaps_a_shaped_allreduce() -> None:
    with Testbed(400) as tb:
        names = tb.ns
        res = tb.run([sys.executable, "-m", "tests.harness.testbed", "probe", "--mbytes", "8", "--reps", "40"],
                     timeout=120)
    assert all(r.returncode == 0 for r in res), [r.stderr[-500:] for r in res]
    m = json.loads(res[0].stdout.strip().splitlines()[-1])
    # 8 MB over 400 Mbit/s is about 0.17 s of wire time whatever the CPU does.
    assert m["allreduce_s"] > 0.12
    serial = m["allreduce_s"] + m["compute_s"]
    assert m["overlapped_s"] < serial - 0.5 * min(m["allreduce_s"], m["compute_s"]), m
    assert not any(n in _namespaces() for n in names)  # torn down


def test_p2p_probe_moves_the_message_at_the_shaped_rate_at_most() -> None:
    """`tests.harness.testbed p2p`: the pipeline's send/recv over the link (how benchmarks/pipeline_testbed.py
    checks its link model). A message cannot beat the shaped rate, whatever the load: one way, 1 MB at
    100 Mbit/s takes at least ~80 ms."""
    with Testbed(100) as tb:
        res = tb.run([sys.executable, "-m", "tests.harness.testbed", "p2p", "--mbytes", "1", "--reps", "3"],
                     timeout=120)
    assert all(r.returncode == 0 for r in res), [r.stderr[-500:] for r in res]
    m = json.loads(res[0].stdout.strip().splitlines()[-1])
    assert m["bytes"] == 1e6
    assert m["bandwidth_Bps"] <= 100e6 / 8 * 1.05, m  # tbf's burst allowance: a few percent at most


def test_cut_link_fails_both_ranks_within_timeout(tmp_path: Path) -> None:
    from lynx.api import make_problem
    from lynx.methods import get_method
    from lynx.models import load_model
    from lynx.plan import Plan
    from lynx.problem import PlanOptions
    from lynx.spec import ParallelSpec, load_hardware

    par = ParallelSpec(tp=2, micro_batch_size=2, global_batch_size=4, seq_length=64)
    prob = make_problem(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), par, PlanOptions())
    plan = tmp_path / "plan.json"
    Plan.evaluate(prob, get_method("selective").fn(prob)).save(plan)
    timeout = 8
    with Testbed(200) as tb:
        port = 20000 + (hash(str(tmp_path)) % 20000)
        argv = [sys.executable, "-m", "lynx.runtime.train", "--plan", str(plan), "--iters", "100000",
                "--warmup", "0", "--timeout", str(timeout), "--threads", "1"]
        procs = [tb.popen(r, argv, port) for r in (0, 1)]
        try:
            first = procs[0].stdout.readline()  # an iteration finished: the ranks are talking
            assert first.startswith("iter"), first
            tb.cut_link()
            t_cut = time.monotonic()
            errs = [p.communicate(timeout=timeout + 60)[1] for p in procs]
            elapsed = time.monotonic() - t_cut
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert [p.returncode for p in procs] == [1, 1], errs
    for r in (0, 1):
        assert f"rank {r}/2 failed" in errs[r], errs[r][-500:]
    assert elapsed < timeout + 45
