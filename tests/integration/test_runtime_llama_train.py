"""`lynx train --plan` on LLaMA plans in every layout: PP 2 x TP 2 and PP 2 x DP 2 train the llama-tiny
preset with the loss of every iteration equal to the single-process run of the same data (PP 1, TP 1,
DP 1, same global batch, AdamW); an unequal gradient would change the losses after the first step. The
gradients themselves are compared bit for bit in `test_runtime_pipeline.py::test_llama_*`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from lynx.api import make_problem  # noqa: E402
from lynx.methods import get_method  # noqa: E402
from lynx.models import load_model
from lynx.plan import Plan  # noqa: E402
from lynx.problem import PlanOptions  # noqa: E402
from lynx.spec import ParallelSpec, load_hardware

ITERS = 3


def _plan(path: Path, method: str, tp: int, pp: int, dp: int, global_batch: int) -> Path:
    par = ParallelSpec(tp=tp, pp=pp, dp=dp, micro_batch_size=2, global_batch_size=global_batch, seq_length=32)
    prob = make_problem(load_model("llama-tiny"), load_hardware("a100-40g-nvlink"), par, PlanOptions())
    Plan.evaluate(prob, get_method(method).fn(prob)).save(path)
    return path


def _losses(plan: Path, out: Path) -> list[float]:
    p = subprocess.run([sys.executable, "-m", "lynx", "train", "--plan", str(plan), "--iters", str(ITERS),
                        "--warmup", "0", "--threads", "1", "--quiet", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return [it["loss"] for it in json.loads(out.read_text())["iterations"]]


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) == ITERS and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("tp,dp", [(1, 2), pytest.param(2, 1, marks=pytest.mark.slow)])
def test_llama_pipeline_trains_as_the_single_process_run(tmp_path: Path, tp: int, dp: int) -> None:
    single = _losses(_plan(tmp_path / "one.json", "selective", 1, 1, 1, 4 * dp), tmp_path / "one.out.json")
    piped = _losses(_plan(tmp_path / "pp.json", "lynx", tp, 2, dp, 4 * dp), tmp_path / "pp.out.json")
    assert _close(piped, single), (piped, single)
    assert single[-1] < single[0]  # it learns
