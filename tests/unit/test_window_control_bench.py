"""benchmarks/window_control.py: the A B A' analysis (what the windows hid, its noise, the two targets) and
the normalisation of both runners' reports, on hand-made reports (no testbed, no torch)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
wc = importlib.import_module("window_control")


def _run(times: list[float], window: float = 0.0, ondemand: float = 0.0) -> dict:
    return {"times": times, "median_s": sorted(times)[len(times) // 2],
            "stages": {"0": {"window_s": window, "cooldown_s": 0.0, "ondemand_s": ondemand}}}


PRED = {"hidden_s": 0.10, "control_recompute_s": 0.2,
        "plan_stages": [{"hidden_s": 0.1, "critical_s": 0.1}], "control_stages": [{"hidden_s": 0.0, "critical_s": 0.2}]}


def _rounds(a: float, b: float, a2: float, n: int = 3) -> list[dict]:
    return [{"A": _run([a, a + 0.01, a + 0.02], 0.1, 0.1), "B": _run([b, b + 0.01, b + 0.02], 0.0, 0.2),
             "A2": _run([a2, a2 + 0.01, a2 + 0.02], 0.1, 0.1)} for _ in range(n)]


def test_measured_hidden_is_control_minus_plan_medians_and_noise_is_a_vs_a_again() -> None:
    an = wc.analyse(_rounds(1.00, 1.12, 1.02), PRED)
    assert an["measured_hidden_s"] == pytest.approx(0.11)  # median(B)=1.13, median(A and A')=1.02
    assert an["noise_aa_s"] == pytest.approx(0.02)
    assert an["placebo_s"] == pytest.approx(0.02) and an["per_round_se_s"] == pytest.approx(0.0)
    assert an["per_round_s"] == pytest.approx([0.11, 0.11, 0.11]) and an["spread_s"] == pytest.approx(0.0)
    assert an["control_recompute_s"] == pytest.approx(0.2)
    assert an["beyond_noise"] and an["agrees"]  # 0.11 > 0.06; |0.11 - 0.10| <= 0.05


def test_targets_fail_when_the_noise_or_the_miss_is_too_large() -> None:
    noisy = wc.analyse(_rounds(1.00, 1.12, 1.10), PRED)  # A and A' differ by 0.10: 3 x placebo > hidden
    assert not noisy["beyond_noise"]
    scattered = [{"A": _run([1.0]), "B": _run([1.0 + d]), "A2": _run([1.0])} for d in (0.3, -0.2, 0.25, -0.15)]
    assert not wc.analyse(scattered, PRED)["beyond_noise"]  # no placebo gap, but the rounds disagree
    off = wc.analyse(_rounds(1.00, 1.40, 1.00), PRED)  # hides 0.40 s where 0.10 was predicted
    assert off["beyond_noise"] and not off["agrees"]
    text = wc.report_text(off, PRED)
    assert "targets: 1 of 2 hold" in text and "[red]" not in text


def test_reports_of_both_runners_are_normalised_per_stage() -> None:
    tp_only = {"iterations": [
        {"warmup": True, "time_s": 9.0, "recompute_window_s": 9.0, "recompute_ondemand_s": 9.0},
        {"warmup": False, "time_s": 1.0, "recompute_window_s": 0.1, "recompute_ondemand_s": 0.3},
        {"warmup": False, "time_s": 2.0, "recompute_window_s": 0.3, "recompute_ondemand_s": 0.1}]}
    s = wc.run_summary(tp_only)
    assert s["times"] == [1.0, 2.0] and s["median_s"] == 1.5
    assert s["stages"] == {"0": pytest.approx({"window_s": 0.2, "cooldown_s": 0.0, "ondemand_s": 0.2})}
    pipe = {"iterations": tp_only["iterations"], "stages": {
        "0": {"window_s": 0.15, "cooldown_s": 0.05, "ondemand_s": 0.0, "rank": 0},
        "1": {"window_s": 0.0, "cooldown_s": 0.0, "ondemand_s": 0.2, "rank": 1}}}
    # the engine's window_s counts the cool-down too: the summary splits them
    split = wc.run_summary(pipe)["stages"]["0"]
    assert split == pytest.approx({"window_s": 0.1, "cooldown_s": 0.05, "ondemand_s": 0.0})


def test_budget_is_the_largest_per_stage_fraction_between_full_and_none() -> None:
    peaks = {"full": [80.0, 70.0], "none": [120.0, 90.0]}
    assert wc.budget_of(peaks, 0.5) == 100.0
    assert wc.budget_of(peaks, 0.0) == 80.0


def test_from_json_refuses_a_file_that_is_not_a_saved_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"rows": {}}')
    with pytest.raises(SystemExit) as e:
        wc.from_json(bad)
    assert e.value.code == 2 and "not a saved run" in capsys.readouterr().err
