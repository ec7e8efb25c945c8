"""benchmarks/gpu_offload.py off the GPU: it skips with one line and exit 0 without CUDA, its targets decide
right on hand-made measurements (and say n/a for what was not measured), and the planner's sizes it copies are
one Llama-3-70B TP 8 layer's offloaded tensors."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = importlib.import_module("gpu_offload")
from _targets import Targets  # noqa: E402

GOOD = {"link_d2h_Bps": 25e9, "link_h2d_Bps": 25e9, "d2h_Bps": 40e9, "h2d_Bps": 30e9, "exposed_s": 0.001,
        "predicted_exposed_s": 0.0, "copy_s": 0.1, "peak_bytes": 900, "planned_peak_bytes": 1000}


def _holds(m: dict) -> list[str]:
    return [r[3] for r in bench.table_rows(m, Targets())]


def test_targets_hold_on_good_figures() -> None:
    t = Targets()
    rows = bench.table_rows(GOOD, t)
    assert [r[0].split(",")[0] for r in rows] == ["d2h bandwidth", "h2d bandwidth", "exposed copy time beside GEMMs",
                                                  "offloading engine's allocator peak"]
    assert all(c.holds for c in t.checks)


@pytest.mark.parametrize(("key", "value", "row"), [("d2h_Bps", 20e9, 0), ("h2d_Bps", 24.9e9, 1),
                                                   ("exposed_s", 0.0101, 2), ("peak_bytes", 1001, 3)])
def test_each_target_fails_when_its_figure_is_off(key: str, value: float, row: int) -> None:
    t = Targets()
    bench.table_rows({**GOOD, key: value}, t)
    assert [c.holds for c in t.checks] == [i != row for i in range(4)]


def test_unmeasured_figures_are_na_not_yes() -> None:
    t = Targets()
    rows = bench.table_rows({"link_d2h_Bps": 25e9, "link_h2d_Bps": 25e9}, t)
    assert all(r[1] == "n/a" for r in rows)
    assert all(c.holds is None for c in t.checks)


def test_sizes_are_a_70b_tp8_layers_offloaded_tensors() -> None:
    sizes, d2h, h2d = bench.layer_offload_sizes()
    assert sizes and all(n > 0 for _, n in sizes)
    # Llama-3-70B: hidden 8192, 8 KV heads of 128 -> QKV's output is 32768 x (8192 + 2 x 1024) / TP 8 bf16
    # elements; gate_up's 32768 x 2 x 28672 / 8; the residual stream's 32768 x 8192 (no sequence parallelism)
    expect = {"qkv": 32768 * (8192 + 2 * 1024) // 8 * 2, "gate_up": 32768 * 2 * 28672 // 8 * 2,
              "attn_residual": 32768 * 8192 * 2}
    got = dict(sizes)
    assert {k: got[k] for k in expect if k in got} == {k: v for k, v in expect.items() if k in got}
    assert set(got) & set(expect), got
    assert d2h == h2d == 25e9  # PCIe Gen5 x16 shared by two GPUs (lynx.spec.default_host_link)


def test_skips_without_cuda() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark runs instead of skipping")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_offload.py")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().count("\n") == 0 and "skipped, no CUDA device" in r.stdout


def test_peak_run_offloads_what_the_planner_says_on_the_cpu() -> None:
    """The peak measurement's engine run, small and on the CPU (no allocator figure): it offloads per micro-batch
    exactly the planner's bytes, and the engine's own peak is within the planned one."""
    pytest.importorskip("torch")
    m = bench.measure_peak(layers=2, hidden=64, seq=16, mb=2, device="cpu")
    assert m["peak_bytes"] is None
    assert m["offloaded_bytes_per_microbatch"] == m["predicted_offloaded_bytes_per_microbatch"] > 0
    assert m["engine_peak_bytes"] <= m["predicted_peak_bytes"] <= m["planned_peak_bytes"]
