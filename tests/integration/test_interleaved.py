"""Interleaved 1F1B end to end: every fast method plans with --vpp 2, its plan file re-simulates to the same
prediction, and the CLI prints schedules, writes torch CSV and simulates a user's schedule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lynx.api import plan
from lynx.methods import available_methods, get_method
from lynx.plan import Plan, load_plan
from tests.conftest import problem_for

FAST = [m for m in available_methods() if get_method(m).in_compare]


def lynx(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    if "PYTHONPATH" in os.environ:  # run the tree under test, not the installed one
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run([sys.executable, "-m", "lynx", *args], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.mark.parametrize("method", FAST)
def test_every_fast_method_plans_interleaved(tmp_path: Path, method: str) -> None:
    prob = problem_for(vpp=2, mb=4, gb=64)
    p = plan(prob, method)
    part = p.result.partition
    assert part.num_chunks == 2 and len(part.chunks) == 8 and sum(part.chunks) == prob.model.num_layers
    for ctx in prob.stage_contexts(part):
        assert ctx.chunk_in_flight[0] >= ctx.chunk_in_flight[1]  # earlier chunks hold more micro-batches
    f = tmp_path / "plan.json"
    p.save(f)
    d = json.loads(f.read_text())
    assert d["schema_version"] == 2 and d["options"]["vpp"] == 2 and d["partition"]["chunks"] == list(part.chunks)
    problem, result = load_plan(f)
    assert Plan.evaluate(problem, result).prediction == p.prediction


def test_first_rank_holds_more_when_interleaved() -> None:
    """Megatron's interleaving memory penalty: rank 0 holds more activations than with plain 1F1B."""
    flat, inter = plan(problem_for(mb=4, gb=64), "none"), plan(problem_for(vpp=2, mb=4, gb=64), "none")
    act = [s.peak_memory_bytes - s.static_bytes for s in (flat.sim.stages[0], inter.sim.stages[0])]
    assert act[1] > act[0]
    assert inter.sim.bubble_fraction < flat.sim.bubble_fraction


def test_cli_schedule_plan_and_simulate(tmp_path: Path) -> None:
    r = lynx("schedule", "--pp", "4", "--micro-batches", "8", "--vpp", "2", "--csv", str(tmp_path / "s.csv"))
    assert r.returncode == 0, r.stderr
    assert "4F0" in r.stdout and "7B0" in r.stdout
    assert (tmp_path / "s.csv").read_text().splitlines()[0].startswith("0F0,0F1,0F2,0F3,4F0")
    bad = lynx("schedule", "--pp", "4", "--micro-batches", "6", "--vpp", "2")
    assert bad.returncode == 2 and "multiple of pp" in bad.stderr
    out = tmp_path / "plan.json"
    args = ("plan", "--vpp", "2", "--micro-batch", "4", "--global-batch", "32", "--method", "lynx")
    r = lynx(*args, "--out", str(out))
    assert r.returncode == 0, r.stderr
    r = lynx("schedule", "--plan", str(out), "--csv", str(tmp_path / "plan.csv"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "plan.csv").read_text() == (tmp_path / "s.csv").read_text()  # the plan's own schedule
    sim = lynx("simulate", str(out), "--schedule", str(tmp_path / "s.csv"), "--json")
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["iteration_time_s"] == json.loads(out.read_text())["prediction"]["iteration_time_s"]
    (tmp_path / "bad.csv").write_text("0F0,0B0\n")
    r = lynx("simulate", str(out), "--schedule", str(tmp_path / "bad.csv"))
    assert r.returncode == 2 and "--schedule" in r.stderr
    r = lynx("plan", "--vpp", "2", "--global-batch", "48")  # 6 micro-batches on 4 ranks
    assert r.returncode == 2 and "multiple of --pp" in r.stderr
