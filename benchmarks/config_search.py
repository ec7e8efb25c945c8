"""How fast `lynx plan --gpus N` searches, and whether its pick beats a published configuration.

    python benchmarks/config_search.py --case llama3-70b-64      # target: >= 1,000 planned in <= 30 s
    python benchmarks/config_search.py --case llama3.1-405b-1024  # target: <= 60 s
    python benchmarks/config_search.py --case gpt3-175b-96        # lynx's pick vs Megatron's published run

Prints candidates considered, pruned, planned and the time, the targets and whether they hold (exit 1 when
one does not). The published case is Megatron-LM's strong-scaling GPT-3 run on H100 (README, "Strong Scaling
Results": GPT-3 175B with a 131,072-token vocabulary, sequence 4096, batch 1152 sequences, 96 GPUs at 47%
MFU; TP 4, PP 8 as the README's table and NVIDIA's GPT-3 recipe give it, so DP 3). Its layout is priced with
every stock Megatron-Core recompute flag beside the search's pick; the search keeps the published micro-batch
(1) and schedule (1F1B) and searches TP, PP, DP, SP, optimizer sharding and method (with 1,152 sequences the
free micro-batch and VPP dimensions take this machine over ten minutes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lynx.problem import PlanOptions
from lynx.search import Pins, SearchResult, Space, search
from lynx.spec import load_hardware, load_model

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Case:
    model: str
    gpus: int
    global_batch: int
    seq_len: int
    planned_at_least: int
    seconds_at_most: float
    published: Pins | None = None
    published_mfu: float = 0.0
    pins: Pins = field(default_factory=Pins)


CASES = {
    "llama3-70b-64": Case("llama3-70b", 64, 512, 8192, 1000, 30.0),
    "llama3.1-405b-1024": Case("llama3.1-405b", 1024, 2048, 8192, 0, 60.0),
    "gpt3-175b-96": Case(str(HERE / "models" / "gpt3-175b-megatron.yaml"), 96, 1152, 4096, 0, 600.0,
                         published=Pins(tp=4, pp=8, vpp=1, mb=1, sp=True, dist_opt=True), published_mfu=0.47,
                         pins=Pins(mb=1, vpp=1)),
}


def _line(res: SearchResult) -> str:
    return (f"considered {res.considered}, pruned {res.pruned} (memory bound {res.count('over budget (bound)')}, "
            f"time bound {res.count('pruned (time bound)')}), planned {res.planned} "
            f"({res.simulated} simulated, {res.count('planned')} fit), invalid {res.count('invalid')}; "
            f"{res.seconds:.1f} s; "
            f"{res.stage_problems} stage problems solved, {res.stage_hits} reused")


def _published(case: Case, space: Space, opts: PlanOptions, res: SearchResult) -> bool:
    assert case.published is not None
    pub = search(Space(space.model, space.hardware, space.gpus, space.global_batch, space.seq_len,
                       Pins(**{**_pins(case.published), "methods": None})), opts, top=50, exhaustive=True)
    stock = pub.best_stock
    best = res.best
    if stock is None or best is None:
        print(f"published layout: {'no stock flag fits' if stock is None else 'ok'}; pick: {best}")
        return False
    print(f"published layout {stock.candidate.layout.label()} ({stock.candidate.method}): predicted "
          f"{stock.iteration_s:.2f} s, MFU {stock.mfu:.1%} (measured {case.published_mfu:.0%})")
    print(f"lynx's pick     {best.candidate.layout.label()} ({best.candidate.method}): predicted "
          f"{best.iteration_s:.2f} s, MFU {best.mfu:.1%}")
    holds = best.iteration_s <= stock.iteration_s
    print(f"target: pick predicted at least as fast as the published configuration: "
          f"{'holds' if holds else 'DOES NOT HOLD'} ({stock.iteration_s / best.iteration_s - 1:+.1%})")
    return holds


def _pins(p: Pins) -> dict[str, object]:
    return {f: getattr(p, f) for f in ("tp", "pp", "vpp", "sp", "mb", "dist_opt")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), default="llama3-70b-64")
    ap.add_argument("--hardware", default="h100-80g-nvlink")
    ap.add_argument("--precision", default="megatron-bf16")
    args = ap.parse_args()
    case = CASES[args.case]
    space = Space(load_model(case.model), load_hardware(args.hardware), case.gpus, case.global_batch, case.seq_len,
                  case.pins)
    opts = PlanOptions(precision=args.precision)  # type: ignore[arg-type]
    print(f"{args.case}: {case.gpus} x {args.hardware}, batch {case.global_batch}, seq {case.seq_len}; "
          f"load average {os.getloadavg()[0]:.2f} (2-core VM, shared)")
    t0, c0 = time.perf_counter(), time.process_time()
    res = search(space, opts)
    wall = time.perf_counter() - t0
    print(_line(res) + f"; CPU {time.process_time() - c0:.1f} s of this process (wall time counts the machine's "
          "other tenants too)")
    if res.best is not None:
        b = res.best
        print(f"pick: {b.candidate.layout.label()} {b.candidate.method}: {b.iteration_s:.2f} s, MFU {b.mfu:.1%}, "
              f"peak {max(b.stage_peak_gib):.1f} GiB")
    ok = True
    if case.planned_at_least:
        holds = res.planned >= case.planned_at_least and wall <= case.seconds_at_most
        print(f"target: >= {case.planned_at_least} candidates planned in <= {case.seconds_at_most:.0f} s: "
              f"{'holds' if holds else 'DOES NOT HOLD'} ({res.planned} planned, {res.simulated} of them "
              f"simulated, in {wall:.1f} s)")
        ok &= holds
    else:
        holds = wall <= case.seconds_at_most
        print(f"target: <= {case.seconds_at_most:.0f} s: {'holds' if holds else 'DOES NOT HOLD'} ({wall:.1f} s)")
        ok &= holds
    if case.published is not None:
        ok &= _published(case, space, opts, res)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
