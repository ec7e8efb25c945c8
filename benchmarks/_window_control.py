"""The window control of a plan: the same partition and the same kept/dropped ops, with
every recomputation the plan places in a window (phases 1-4) or a cool-down stall moved on demand (phase 5).
Held bytes after forward are the same; run interleaved with the plan, the time it adds is what the windows
hid. Shared by benchmarks/testbed_experiment.py (TP) and benchmarks/pipeline_testbed.py (PP)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from lynx.decisions import Phase
from lynx.plan import Plan, load_plan
from lynx.problem import PlanProblem, PlanResult


def hides_anything(result: PlanResult) -> bool:
    windowed = any(p != Phase.ON_DEMAND for pol in result.policies for lp in pol.layers for _, p in lp.recompute)
    return windowed or any(pol.cooldown_overlap and any(lp.recompute for lp in pol.layers) for pol in result.policies)


def control_of(result: PlanResult) -> PlanResult:
    pols = tuple(replace(pol, cooldown_overlap=False, layers=tuple(
        replace(lp, recompute=tuple((n, Phase.ON_DEMAND) for n, _ in lp.recompute)) for lp in pol.layers))
        for pol in result.policies)
    return PlanResult(f"{result.method} (windows on demand)", result.partition, pols, ("window control",), 0.0)


def save_control(problem: PlanProblem, result: PlanResult, out: Path) -> bool:
    """Write the control plan to `out`; False (nothing written) when the plan hides nothing."""
    if not hides_anything(result):
        return False
    Plan.evaluate(problem, control_of(result)).save(out)
    return True


def control_file(plan_path: Path, out: Path) -> bool:
    problem, result = load_plan(plan_path)
    return save_control(problem, result, out)


def check_control_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The options both window controls share: one usage error (exit 2) naming the option and what is valid."""
    if args.budget_frac != "auto":
        try:
            ok = 0 < float(args.budget_frac) <= 1
        except ValueError:
            ok = False
        if not ok:
            ap.error(f"--budget-frac: {args.budget_frac!r} is not auto or a number in (0, 1]")
    if not 0 <= args.min_signal < 1:
        ap.error(f"--min-signal {args.min_signal}: expected a fraction in [0, 1)")


def profile_rank_and_exit(layer: Any, x: Any, group: Any, cfg: Any, full: Any, out_path: str) -> None:
    """The framework controls' per-rank profile of one layer (window_control_torchtitan / _megatron): the ops'
    times with `OpRunner` (warm-up, then `cfg.repeats`), what backward saves, the restore times of `full` (the
    layer's full recomputation), the allocator's peaks; rank 0 pickles it to `out_path`; the process exits."""
    import os
    import pickle

    import torch
    import torch.distributed as dist

    from lynx.profile.measure import OpRunner, count_saved, restore_times
    from lynx.profile.profiler import device_name, measure_peaks

    saved = count_saved(layer, x.detach().requires_grad_())
    runner = OpRunner(layer, x, group)
    for r in range(cfg.warmup + cfg.repeats):
        runner.repeat(record=r >= cfg.warmup)
    restore = restore_times(layer, x, full, cfg.repeats)
    peaks = measure_peaks(torch.device("cpu"), torch.float32, runner.timer)
    raw = {"op_names": list(layer.op_names), "op_inputs": {k: list(v) for k, v in layer.op_inputs.items()},
           "stats": {n: {k: runner.stats(k, n) for k in ("fwd", "dgrad", "wgrad")} for n in layer.op_names},
           "split": dict(runner.samples.split), "disturbed_fraction": runner.disturbed_fraction(),
           "saved": saved, "peaks": peaks, "restore": restore, "device": device_name(torch.device("cpu")),
           "threads": torch.get_num_threads()}
    if dist.get_rank() == 0:
        Path(out_path).write_bytes(pickle.dumps(raw))
    dist.barrier()
    os._exit(0)  # gloo's destructors abort now and then after a clean run (as `lynx train` does)
