"""`lynx train`: a plan runs, its measured activation bytes match the plan's, bad plans and dead ranks fail
with one clear line (never a hang)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
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


def write_plan(path: Path, method: str, tp: int = 1, pp: int = 1, seq: int = 32) -> Path:
    par = ParallelSpec(tp=tp, pp=pp, micro_batch_size=2, global_batch_size=4, seq_length=seq)
    prob = make_problem(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), par, PlanOptions())
    Plan.evaluate(prob, get_method(method).fn(prob)).save(path)
    return path


@pytest.mark.parametrize("method", ["none", "full"])
def test_train_tp1_reports_and_matches_predicted_bytes(tmp_path: Path, method: str) -> None:
    from lynx.runtime.train import main

    plan = write_plan(tmp_path / "plan.json", method)
    out = tmp_path / "r.json"
    main(["--plan", str(plan), "--iters", "2", "--warmup", "0", "--out", str(out), "--quiet", "--threads", "1"])
    r = json.loads(out.read_text())
    assert len(r["iterations"]) == 2 and all(it["loss"] > 0 for it in r["iterations"])
    assert r["measured_act_after_fwd_bytes"] == r["predicted_act_after_fwd_bytes"]
    if method == "full":
        assert r["iterations"][0]["restored_on_demand"] > 0
    else:
        assert r["iterations"][0]["restored_on_demand"] == 0


def test_train_text_file(tmp_path: Path) -> None:
    from lynx.runtime.train import main

    plan = write_plan(tmp_path / "plan.json", "selective")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "r.json"
    main(["--plan", str(plan), "--iters", "1", "--warmup", "0", "--data", str(text), "--out", str(out), "--quiet",
          "--threads", "1"])
    assert json.loads(out.read_text())["iterations"][0]["loss"] > 0


def test_dead_rank_fails_fast_with_rank_and_cause(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", "selective", tp=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    t0 = time.monotonic()
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            probe_command(["--die-at", "1", "--die-rank", "1"],
                          ["--plan", str(plan), "--iters", "4", "--threads", "1", "--timeout", "20", "--quiet"]),
            env=probe_env(env), stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert procs[1].returncode == 17
    assert procs[0].returncode == 1
    assert "rank 0/2 failed" in errs[0]
    assert time.monotonic() - t0 < 60


def test_plan_and_layer_vocabularies_must_agree(tmp_path: Path) -> None:
    from lynx.runtime.train import main

    plan = write_plan(tmp_path / "plan.json", "selective")
    with pytest.raises(SystemExit) as e:
        main(["--plan", str(plan), "--core-attn", "--iters", "1"])
    assert e.value.code == 2


@pytest.mark.parametrize("method", ["mc-mlp", "full"])
def test_train_llama_plan_picks_the_llama_layer(tmp_path: Path, method: str) -> None:
    """The plan's model family picks the runtime layer; measured bytes held after forward = the plan's."""
    from lynx.runtime.train import main

    par = ParallelSpec(tp=1, pp=1, micro_batch_size=2, global_batch_size=4, seq_length=32)
    prob = make_problem(load_model("llama-tiny"), load_hardware("a100-40g-nvlink"), par, PlanOptions())
    plan = tmp_path / "plan.json"
    Plan.evaluate(prob, get_method(method).fn(prob)).save(plan)
    out = tmp_path / "r.json"
    main(["--plan", str(plan), "--iters", "1", "--warmup", "0", "--out", str(out), "--quiet", "--threads", "1"])
    r = json.loads(out.read_text())
    assert r["iterations"][0]["loss"] > 0 and r["iterations"][0]["restored_on_demand"] > 0
    assert r["measured_act_after_fwd_bytes"] == r["predicted_act_after_fwd_bytes"]
