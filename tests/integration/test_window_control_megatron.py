"""benchmarks/window_control_megatron.py: its smallest configuration (`--smoke`) end to end on the namespace
testbed (netns, slow: skipped without root / `ip netns` / megatron-core), and its bad-input refusals (fast, no
testbed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.testbed import unavailable

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "window_control_megatron.py"


def _run(*argv: str, timeout: float = 1200.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.mark.parametrize("argv, says", [(("--budget-frac", "1.5"), "--budget-frac"),
                                         (("--layers", "3"), "--layers 3"), (("--rate", "-1"), "--rate")])
def test_bad_options_are_one_clear_line_and_exit_2(argv: tuple[str, ...], says: str) -> None:
    p = _run(*argv, timeout=120)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr


@pytest.mark.netns
def test_smoke_runs_megatrons_model_with_the_plan_and_its_control(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    reason = unavailable()
    if reason:
        pytest.skip(f"testbed unavailable: {reason}")
    out = tmp_path / "wc.json"
    p = _run("--smoke", "--out", str(out))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "measured hidden s (B - A)" in p.stdout and "targets:" in p.stdout
    saved = json.loads(out.read_text())
    pred, (rnd,) = saved["prediction"], saved["rounds"]
    for stage in ("0", "1"):  # the control restores only on demand, at most what the plan restores in all (a stage
        a, b = rnd["A"]["by_window"][stage], rnd["B"]["by_window"][stage]  # that fits keeping all restores none)
        assert set(b) <= {"on_demand"} and b.get("on_demand", 0) <= sum(a.values())
        assert rnd["B"]["stages"][stage]["window_s"] == 0.0
        assert (rnd["B"]["stages"][stage]["ondemand_s"] > 0) == (b.get("on_demand", 0) > 0)
    assert any(rnd["B"]["by_window"][s].get("on_demand", 0) > 0 for s in ("0", "1"))
    a0 = rnd["A"]["by_window"]["0"]
    assert (sum(v for k, v in a0.items() if k != "on_demand") > 0) == (pred["window_recompute_s"] > 0)
    for x in ("A", "B", "A2"):
        assert len(rnd[x]["times"]) == 2 and all(t > 0 for t in rnd[x]["times"])
