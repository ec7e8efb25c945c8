"""benchmarks/megatron_readme.py: the published step times follow from the table (Megatron's FLOPs count), and
the calibrated H100 preset keeps the rows it fits within the issue's +-10% (a regression guard on the cost model;
the row it misses, 32B, is explained in docs/benchmarks.md section 18)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from lynx.spec import load_hardware

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
mr = importlib.import_module("megatron_readme")


def _megatron_flops(r: object) -> float:
    """megatron/training/training.py num_floating_point_operations (r0.8.0) for a GPT without GQA / SwiGLU."""
    b, s, L, h, V = r.global_batch, mr.SEQ, r.layers, r.hidden, mr.VOCAB  # type: ignore[attr-defined]
    return 12 * b * s * L * h * h * ((1 + 1 + s / h) + 4 + V / (2 * L * h))


@pytest.mark.parametrize("row", mr.ROWS, ids=lambda r: r.name)
def test_published_step_time_is_megatrons_flops_over_the_reported_rate(row: object) -> None:
    gpus = row.tp * row.pp * mr.DP  # type: ignore[attr-defined]
    expect = _megatron_flops(row) / (row.tflops_per_gpu * 1e12 * gpus)  # type: ignore[attr-defined]
    assert mr.published_step_s(row) == pytest.approx(expect, rel=1e-9)


def test_calibrated_h100_holds_eight_of_nine_rows_and_overlaps_matter() -> None:
    hw = load_hardware("h100-80g-nvlink")
    rows = mr.errors(hw)
    ok = [r.name for r, pub, (pred, _) in rows if abs(pred / pub - 1) <= mr.TARGET]
    assert len(ok) >= 8, ok
    assert {"1.7B", "7.1B", "16B", "70B", "119B", "177B", "314B", "462B"} <= set(ok)
    plain = mr.errors(hw, overlaps=False)
    for (r, _, (with_ov, _)), (_, _, (without, _)) in zip(rows, plain, strict=True):
        assert with_ov < without, r.name


def test_interleaving_shrinks_the_strong_scaling_bubble_and_defaults_are_unchanged() -> None:
    hw = load_hardware("h100-80g-nvlink")
    plain = mr.held_out()
    assert plain == mr.held_out(hw, 1, 1)
    inter = mr.held_out(hw, 1, mr.INTERLEAVE["1 layer per chunk"](mr.ROWS[6].layers // mr.ROWS[6].pp))
    assert inter[1][3] < plain[1][3]  # DP 96: 12 micro-batches, the bubble is most of the gap
    assert inter[0][3] <= plain[0][3] * 1.01  # DP 2: 576 micro-batches, the bubble hardly matters


@pytest.mark.parametrize("rule", list(mr.INTERLEAVE))
def test_interleaving_rules_give_chunks_megatron_accepts(rule: str) -> None:
    for r in mr.ROWS:
        v = mr.vpp_of(r, rule)
        assert v >= 1 and (r.layers // r.pp) % v == 0, (r.name, v)
        assert r.pp > 1 or v == 1
