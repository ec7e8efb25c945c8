"""The window control of a plan: the same partition and the same kept/dropped ops, with
every recomputation the plan places in a window (phases 1-4) or a cool-down stall moved on demand (phase 5).
Held bytes after forward are the same; run interleaved with the plan, the time it adds is what the windows
hid. Shared by benchmarks/testbed_experiment.py (TP) and benchmarks/pipeline_testbed.py (PP)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class ControlDefaults:
    """What differs between the framework window controls' command lines (window_control_torchtitan/_megatron)."""

    name: str
    """The results name: benchmarks/results/<name>.json, raw run in benchmarks/results/raw/<name>.json."""
    layers: int
    layers_help: str
    iters: int
    rounds: int
    smoke_layers: int
    from_json_runs: bool
    """--from-json takes several saved runs (one results file labelled by rate) rather than one."""


def control_parser(description: str, d: ControlDefaults) -> argparse.ArgumentParser:
    """The options both framework window controls share, and the hidden per-rank ones the driver passes."""
    import _results

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--layers", type=int, default=d.layers, help=f"{d.layers_help} (default {d.layers})")
    ap.add_argument("--rate", type=float, default=400.0, help="link rate, Mbit/s (default 400)")
    ap.add_argument("--budget-frac", default="auto", help="as in window_control.py")
    ap.add_argument("--method", default="lynx", choices=("lynx", "lynx-heu"))
    ap.add_argument("--min-signal", type=float, default=0.04,
                    help="refuse when predicted control - plan is below this share of the predicted iteration")
    ap.add_argument("--iters", type=int, default=d.iters, help="timed iterations per training run")
    ap.add_argument("--rounds", type=int, default=d.rounds, help="rounds of A B A'")
    ap.add_argument("--repeats", type=int, default=5, help="profiler repeats")
    ap.add_argument("--smoke", action="store_true", help=f"end to end only: {d.smoke_layers} layers, 2 iterations, "
                    "1 round, 2 profiler repeats, no --min-signal")
    ap.add_argument("--out", type=Path, default=None, help="JSON of the run (default benchmarks/results/raw/"
                    f"{d.name}.json; with --smoke, none unless given)")
    if d.from_json_runs:
        ap.add_argument("--from-json", type=Path, nargs="+", default=None,
                        help="re-print the tables and targets of saved runs (with --results: write their figures)")
    else:
        ap.add_argument("--from-json", type=Path, default=None, help="re-print the tables and targets of a saved run")
    _results.add_option(ap, d.name)
    # inside a rank (run by the driver in the testbed)
    for flag in ("--rank-profile", "--rank-train"):
        ap.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in ("--plan-path", "--out-path"):
        ap.add_argument(flag, default=None, help=argparse.SUPPRESS)
    return ap


def finish_control_args(ap: argparse.ArgumentParser, args: argparse.Namespace, d: ControlDefaults,
                        layers_error: str | None) -> argparse.Namespace:
    """Validate before any work (one usage error, exit 2), then apply --smoke and the default --out.
    `layers_error`: the framework's objection to --layers, if any."""
    import pipeline_testbed as pt

    if args.rank_profile or args.rank_train:
        return args
    check_control_args(ap, args)
    if layers_error:
        ap.error(f"--layers {args.layers}: {layers_error}")
    if args.smoke:
        args.layers, args.iters, args.rounds, args.repeats, args.min_signal = d.smoke_layers, 2, 1, 2, 0.0
    if args.out is None and not args.smoke and args.from_json is None:
        args.out = Path(f"benchmarks/results/raw/{d.name}.json")
    if args.from_json is None:
        pt.check_args(ap, args)
    return args


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
