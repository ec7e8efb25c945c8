"""FP8 runs, measured vs predicted: NVIDIA's DGX Cloud benchmarking recipes on H100 in FP8 (issue 33).

Calibration (`--fit` fits the one FP8 constant, the H100 preset's `fp8_matmul_efficiency`, to these rows only): the
FP8 tables of the recipes benchmarks/published_runs.py prices in BF16, NVIDIA/dgxc-benchmarking at commit 143b90dd
(2025-05-21): llama3.1/README_8b.md "Llama 3.1 8b 24.09 FP8", README_70b.md "Llama 3.1 70b 24.09 FP8",
README_405b.md "Llama 3.1 405b 24.09 FP8", nemotron/README_15b.md "Nemotron4 15b 24.11 FP8", README_340b.md
"Nemotron4 340b 24.11 FP8", nemo_megatron/README_175b.md "NeMo Megatron 24.11 FP8". Each run is its BF16 twin's
configuration (published_runs.py's RUNS: layouts, optimizer, overlaps) with the recipe's FP8 switches: the
configure.sh files set ``model.fp8=True``, ``model.fp8_hybrid=True``, ``+model.fp8_params=True`` (the 175B YAML:
``fp8: true``, ``fp8_hybrid: true``, ``fp8_params: true``) and the YAMLs ``fp8_amax_history_len: 1024``,
``fp8_amax_compute_algo: max``: TransformerEngine's delayed scaling, hybrid format, FP8 parameters - lynx's
``--fp8-format hybrid --fp8-recipe delayed --fp8-param-gather``.

Held out (never fitted): the H100 FP8 rows of a later release, NVIDIA/dgxc-benchmarking v25.04.01 (commit 85380ff),
llama3.1/README.md, NeMo 2.0 recipes (`pretrain_llama31.py`: `bf16_with_fp8_mixed()`, userbuffers TP overlap,
Megatron-Core's distributed optimizer with bf16 gradient reduction, `grad_reduce_in_fp32 = False`): Llama 3.1 8B
(TP 1 PP 1 CP 2), 70B on another layout (TP 4 PP 8 CP 1 VP 5), and the 405B 32-GPU proxy (8 layers, TP 8 CP 2); the
405B rows whose layer counts do not split evenly over PP x VP (30, 62 and 126 layers over 32 or 64 chunks: NeMo's
embedding/loss accounting) are left out rather than re-laid.

Target: +-15% of the measured step time (published_runs.TARGET). Results: `--results
benchmarks/results/fp8_runs.json` (a results record; `--raw` every row).

Run: PYTHONPATH=src python benchmarks/fp8_runs.py [--fit] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import _results
from published_runs import TARGET, Run, _g175, _l8, _l405, _n15, _n340, model_of, parallel_of
from rich.console import Console
from rich.table import Table

from lynx.api import make_problem, plan
from lynx.fp8 import Fp8, Fp8Format, Fp8Recipe
from lynx.problem import PlanOptions
from lynx.spec import Hardware, load_hardware

RECIPE_FP8 = Fp8(Fp8Format.HYBRID, Fp8Recipe.DELAYED, param_gather=True)
"""What every run here sets (module docstring)."""


@dataclass(frozen=True, slots=True)
class Fp8Run:
    run: Run
    """The configuration (published_runs.Run) with the FP8 step time."""
    role: str
    """calibration or held-out."""
    source: str


def _l70(gpus: int, step: float) -> Run:
    # llama3.1/README_70b.md "Llama 3.1 70b 24.09 FP8 (TP=4, PP=4, CP=2, VP=5, MBS=1, GA=64)", GBS = 2 x GPUs;
    # llama3.1_70b.yaml: SP, ub_tp_comm_overlap true, no recompute, distributed_fused_adam with grad_sync_dtype bf16
    # (the BF16 twin is benchmarks/cp_long_context.py's published table)
    # llama3.1_70b.yaml l. 101: cross_entropy_loss_fusion true
    return Run("Llama 3.1 70B, NeMo 24.09", "llama3-70b", 4, 4, 2, 5, 1, 8192, gpus, 2 * gpus, step, ce_fusion=True)


C = "dgxc-benchmarking 143b90dd"
CALIBRATION: tuple[Fp8Run, ...] = tuple(Fp8Run(r, "calibration", C) for r in (
    *(_l8(g, s) for g, s in ((8, 9.67), (16, 9.73), (32, 9.75), (64, 9.80), (128, 9.82))),
    *(_l70(g, s) for g, s in ((64, 11.01), (128, 10.93), (256, 11.16), (512, 11.18), (1024, 11.28), (2048, 11.39))),
    _l405(32, 7, 1, 1, 126, 5.80), _l405(96, 21, 3, 7, 126, 5.71), _l405(192, 42, 3, 7, 252, 11.00),
    _l405(576, 126, 9, 7, 252, 11.24), _l405(1152, 126, 9, 7, 504, 11.31), _l405(2304, 126, 9, 7, 1008, 12.35),
    *(_n15(g, s) for g, s in ((16, 2.08), (32, 2.07), (64, 2.09), (128, 2.08), (256, 2.10), (512, 2.12),
                              (1024, 2.12), (2048, 2.18))),
    *(_n340(g, s) for g, s in ((128, 3.16), (256, 3.21), (512, 3.26), (1024, 3.34), (2048, 3.49))),
    *(_g175(g, s) for g, s in ((128, 5.92), (256, 5.96), (512, 6.44), (1024, 6.72), (2048, 6.24))),
))

NEMO2 = dict(precision="paper", bytes_per_param=None, ce_fusion=True)
"""NeMo 2.0's Megatron-Core distributed optimizer with `grad_reduce_in_fp32 = False`: 2-byte parameters and
gradients, 12 bytes of fp32 state sharded (lynx --precision paper); NeMo 2.0's GPTConfig turns
`cross_entropy_loss_fusion` on by default."""
H = "dgxc-benchmarking v25.04.01 (85380ff)"
HELD_OUT: tuple[Fp8Run, ...] = tuple(Fp8Run(r, "held-out", H) for r in (
    *(replace(_l8(g, s), recipe="Llama 3.1 8B, NeMo 25.02", **NEMO2)  # type: ignore[arg-type]
      for g, s in ((8, 9.33), (16, 9.36), (32, 9.43), (64, 9.48), (128, 9.54))),
    *(replace(Run("Llama 3.1 70B, NeMo 25.02", "llama3-70b", 4, 8, 1, 5, 1, 8192, g, 2 * g, s), **NEMO2)  # type: ignore[arg-type]
      for g, s in ((64, 9.86), (128, 9.95), (256, 10.00), (512, 10.07), (1024, 10.08), (2048, 10.15))),
    replace(Run("Llama 3.1 405B proxy, NeMo 25.02", "llama3.1-405b", 8, 1, 2, 1, 1, 8192, 32, 64, 3.53, layers=8),
            **NEMO2),  # type: ignore[arg-type]
))


def fp8_plan_seconds(r: Run, hw: Hardware) -> tuple[float, float]:
    """(iteration s, the largest stage peak GiB) of lynx's prediction of the FP8 run as its recipe sets it (the same
    options as published_runs.plan_of, the model with the recipe's FP8 setting)."""
    opts = PlanOptions(precision=r.precision, bytes_per_param=r.bytes_per_param,  # type: ignore[arg-type]
                       distributed_optimizer=True, nodes=-(-r.gpus // hw.devices_per_node), vpp=r.vpp,
                       overlap_grad_reduce=True, overlap_param_gather=True,
                       tp_comm_overlap=r.tp_comm_overlap and r.tp > 1, budget_bytes=hw.device.memory_bytes)
    p = plan(make_problem(replace(model_of(r), fp8=RECIPE_FP8), hw, parallel_of(r), opts), r.method, record=False)
    return p.sim.iteration_time_s, max(st.peak_memory_bytes for st in p.sim.stages) / 2**30


def with_fp8_efficiency(hw: Hardware, eff: float) -> Hardware:
    return replace(hw, device=replace(hw.device, fp8_matmul_efficiency=eff))


def fit(hw: Hardware, runs: tuple[Fp8Run, ...]) -> float:
    """The FP8 asymptote that minimises the mean squared log error over `runs` (golden-section search: the
    iteration time falls monotonically as the efficiency rises, so the loss is unimodal)."""
    def loss(e: float) -> float:
        h = with_fp8_efficiency(hw, e)
        return sum(math.log(fp8_plan_seconds(x.run, h)[0] / x.run.step_s) ** 2 for x in runs) / len(runs)

    lo, hi, g = 0.30, 1.00, (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = loss(a), loss(b)
    while hi - lo > 0.004:
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = loss(b)
    return round((lo + hi) / 2, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="h100-80g-nvlink")
    ap.add_argument("--fit", action="store_true", help="fit fp8_matmul_efficiency to the calibration rows first")
    ap.add_argument("--quick", action="store_true", help="one row per recipe")
    ap.add_argument("--raw", type=Path, default=None, help="also write every row as JSON here (results/raw/)")
    _results.add_option(ap, "fp8_runs")
    a = ap.parse_args()
    run = _results.Run()
    hw = load_hardware(a.hardware)
    t0 = time.perf_counter()
    rows = CALIBRATION + HELD_OUT
    if a.quick:
        seen: set[str] = set()
        rows = tuple(x for x in rows if not (x.run.recipe in seen or seen.add(x.run.recipe)))  # type: ignore[func-returns-value]
    fitted = None
    if a.fit:
        fitted = fit(hw, tuple(x for x in rows if x.role == "calibration"))
        print(f"fitted fp8_matmul_efficiency {fitted} (preset: {hw.device.fp8_matmul_efficiency})")
        hw = with_fp8_efficiency(hw, fitted)
    table = Table(title=f"FP8 runs: NVIDIA DGX Cloud benchmarking recipes (H100) vs lynx on {hw.name}, "
                        f"fp8_matmul_efficiency {hw.device.fp8_matmul_efficiency}")
    for c in ("role", "recipe", "TP", "PP", "CP", "VP", "GPUs", "GBS", "published step s", "lynx step s",
              "peak GiB", "error", "target", "holds"):
        table.add_column(c, justify="left" if c in ("role", "recipe") else "right")
    records = []
    for x in rows:
        r = x.run
        pred, peak = fp8_plan_seconds(r, hw)
        err = pred / r.step_s - 1
        ok = abs(err) <= TARGET
        records.append({"role": x.role, "source": x.source, "recipe": r.recipe, "model": r.model, "layers": r.layers,
                        "tp": r.tp, "pp": r.pp, "cp": r.cp, "vpp": r.vpp, "gpus": r.gpus, "gbs": r.gbs,
                        "published_step_s": r.step_s, "lynx_step_s": round(pred, 4), "peak_gib": round(peak, 2),
                        "error": round(err, 4), "target": TARGET, "holds": ok})
        table.add_row(x.role, r.recipe + (f" ({r.layers} layers)" if r.layers else ""), str(r.tp), str(r.pp),
                      str(r.cp), str(r.vpp), str(r.gpus), str(r.gbs), f"{r.step_s:.2f}", f"{pred:.2f}",
                      f"{peak:.1f}", f"{100 * err:+.1f}%", f"±{100 * TARGET:.0f}%", "yes" if ok else "NO")
    con = Console(width=200)
    con.print(table)
    summary = {}
    for role in ("calibration", "held-out"):
        rs = [rec for rec in records if rec["role"] == role]
        if rs:
            held = sum(rec["holds"] for rec in rs)
            worst = max(abs(rec["error"]) for rec in rs)
            summary[role] = {"within": held, "of": len(rs), "worst_abs_error": worst}
            con.print(f"{role}: {held} of {len(rs)} within ±{100 * TARGET:.0f}%, worst |error| {100 * worst:.1f}%")
    elapsed = time.perf_counter() - t0
    con.print(f"{elapsed:.1f} s (measured on a shared, loaded machine)")
    figures = [_results.Figure(f"{rec['role']}: {rec['recipe']} TP{rec['tp']} PP{rec['pp']} CP{rec['cp']} "
                               f"VP{rec['vpp']} {rec['gpus']} GPUs GBS {rec['gbs']}: lynx step",
                               rec["lynx_step_s"], "s",
                               f"published {rec['published_step_s']} s ± {100 * TARGET:.0f}%", rec["holds"],
                               rec["published_step_s"]) for rec in records]
    run.write(a.results, "fp8_runs", "prediction",
              f"FP8 runs: NVIDIA DGX Cloud benchmarking recipes (H100) vs lynx, fp8_matmul_efficiency "
              f"{hw.device.fp8_matmul_efficiency}", figures,
              summary="; ".join(f"{role}: {s['within']} of {s['of']} within ±{100 * TARGET:.0f}%, worst |error| "
                                f"{100 * s['worst_abs_error']:.1f}%" for role, s in summary.items()),
              notes=("calibration rows fitted fp8_matmul_efficiency; held-out rows were never fitted",))
    if a.raw is not None:
        a.raw.parent.mkdir(parents=True, exist_ok=True)
        a.raw.write_text(json.dumps({
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "machine": platform.node(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"), "load_average": os.getloadavg()[0],
            "hardware": hw.name, "fp8_matmul_efficiency": hw.device.fp8_matmul_efficiency, "fitted": fitted,
            "fp8": {"format": RECIPE_FP8.format.value, "recipe": RECIPE_FP8.recipe.value,
                    "param_gather": RECIPE_FP8.param_gather},
            "summary": summary, "rows": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()


__all__ = ["CALIBRATION", "HELD_OUT", "fit", "fp8_plan_seconds"]
