"""Context parallelism on Llama-3.1-70B-shaped runs (issue 21): lynx's predictions across CP sizes and
recomputation methods, at 8k (the published NeMo layout), 32k and 128k tokens, on 64 to 1,024 H100s.

    PYTHONPATH=src python benchmarks/cp_long_context.py [--quick]

Prints one markdown table per (sequence, GPUs): for each layout (TP x CP x PP x DP, VPP) and method the predicted
iteration, tokens/s/GPU, model TFLOP/s/GPU, peak memory of the fullest stage and whether it fits. Planner only
(no torch, no GPU). docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass

from lynx.api import compare, make_problem
from lynx.cli.plan import with_vpp
from lynx.errors import LynxError
from lynx.problem import PlanOptions
from lynx.spec import GiB, ParallelSpec, load_hardware, load_model

METHODS = ("none", "selective", "full", "block", "lynx")


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    pp: int
    dp: int
    vpp: int = 1


SCENARIOS: list[tuple[int, int, int, list[Layout]]] = [
    # (sequence, GPUs, global batch, layouts). 8k: NVIDIA's published Llama 3 70B H100 layout (TP 4 PP 4 CP 2 VP 5,
    # GBS 128: NeMo performance summary 24.09 / DGXC Llama 3.1 recipe) and the same GPUs without CP.
    (8192, 64, 128, [Layout(4, 2, 4, 2, 5), Layout(4, 1, 4, 4, 5), Layout(8, 1, 4, 2, 5)]),
    # 32k: 4M tokens per step (128 sequences)
    (32768, 64, 128, [Layout(8, 1, 4, 2, 5), Layout(8, 2, 4, 1, 5), Layout(4, 4, 4, 1, 5)]),
    (32768, 256, 128, [Layout(8, 1, 4, 8, 5), Layout(8, 2, 4, 4, 5), Layout(8, 4, 4, 2, 5), Layout(8, 8, 4, 1, 5)]),
    (32768, 1024, 128, [Layout(8, 2, 4, 16, 5), Layout(8, 4, 4, 8, 5), Layout(8, 8, 4, 4, 5),
                        Layout(8, 16, 4, 2, 5)]),
    # 128k: 4M tokens per step (32 sequences)
    (131072, 64, 32, [Layout(8, 2, 4, 1, 5), Layout(8, 1, 8, 1, 5)]),
    (131072, 256, 32, [Layout(8, 4, 4, 2, 5), Layout(8, 8, 4, 1, 5), Layout(8, 2, 8, 2, 5)]),
    (131072, 1024, 32, [Layout(8, 8, 4, 4, 5), Layout(8, 16, 4, 2, 5), Layout(8, 32, 4, 1, 5)]),
]


def run(quick: bool) -> None:
    m, hw = load_model("llama3-70b"), load_hardware("h100-80g-nvlink")
    opts_base = PlanOptions(precision="megatron-bf16", distributed_optimizer=True)
    for seq, gpus, gbs, layouts in SCENARIOS[:2] if quick else SCENARIOS:
        print(f"\n#### llama3-70b, seq {seq}, {gpus} x H100, global batch {gbs}, micro-batch 1, SP, bf16, "
              "distributed optimizer\n")
        print("| TP | CP | PP | DP | VPP | method | iter s | tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB | fits |")
        print("|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|")
        for lay in layouts:
            assert lay.tp * lay.cp * lay.pp * lay.dp == gpus, lay
            par = ParallelSpec(tp=lay.tp, cp=lay.cp, pp=lay.pp, dp=lay.dp, sequence_parallel=True, micro_batch_size=1,
                               global_batch_size=gbs, seq_length=seq)
            opts = dataclasses.replace(opts_base, nodes=gpus // hw.devices_per_node)
            try:
                problem = make_problem(m, hw, par, opts)
                if lay.vpp > 1:
                    problem = with_vpp(problem, lay.vpp)
            except LynxError as e:
                print(f"| {lay.tp} | {lay.cp} | {lay.pp} | {lay.dp} | {lay.vpp} | - | {e} | | | | | |")
                continue
            t0 = time.perf_counter()
            for row in compare(problem, METHODS):
                if row.plan is None:
                    print(f"| {lay.tp} | {lay.cp} | {lay.pp} | {lay.dp} | {lay.vpp} | {row.method} | no plan | | | | | "
                          f"no |")
                    continue
                s = row.plan.sim
                tok = s.samples_per_s * seq / gpus
                peak = max(st.peak_memory_bytes for st in s.stages) / GiB
                print(f"| {lay.tp} | {lay.cp} | {lay.pp} | {lay.dp} | {lay.vpp} | {row.method} | "
                      f"{s.iteration_time_s:.2f} | {tok:.0f} | {s.model_tflops_per_gpu:.0f} | {s.mfu:.1%} | "
                      f"{peak:.1f} | {'no' if s.oom else 'yes'} |")
            print(f"<!-- planned in {time.perf_counter() - t0:.1f} s -->", file=sys.stderr)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="the 8k and the 64-GPU 32k tables only")
    run(ap.parse_args().quick)
