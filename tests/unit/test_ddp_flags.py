"""Megatron's two DDP switches that change the passes over the gradient buffer: --no-check-for-nan-in-loss-and-grad
and --ddp-average-in-collective, from a command line to the price and back to the exported flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lynx.api import make_problem, plan
from lynx.cost.static_memory import RECIPES, grad_buffer_passes, grad_buffer_time
from lynx.export.megatron import run_flags
from lynx.export.megatron_args import parse_megatron_args
from lynx.models import load_model
from lynx.plan import load_plan
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec, load_hardware

H100 = "h100-80g-nvlink"
PAR = ParallelSpec(tp=2, pp=1, dp=8, sequence_parallel=True, micro_batch_size=2, global_batch_size=32, seq_length=2048)
BASE = PlanOptions(precision="megatron-bf16", distributed_optimizer=True, nodes=2)


def test_the_passes_for_each_switch() -> None:
    one = dataclasses.replace(PAR, dp=1, global_batch_size=4)
    assert grad_buffer_passes(PAR) == 4
    assert grad_buffer_passes(PAR, check_for_nan=False) == 3
    assert grad_buffer_passes(PAR, average_in_collective=True) == 2
    assert grad_buffer_passes(PAR, False, True) == 1  # the zero_() every iteration stays
    assert grad_buffer_passes(one) == 2 and grad_buffer_passes(one, average_in_collective=True) == 2


@pytest.mark.parametrize(("field", "passes_saved"), [("check_for_nan_in_grad", 1), ("ddp_average_in_collective", 2)])
def test_each_switch_saves_exactly_its_passes(field: str, passes_saved: int) -> None:
    m, hw = load_model("gpt-7b"), load_hardware(H100)
    on = plan(make_problem(m, hw, PAR, BASE), "none", record=False).sim.iteration_time_s
    value = field != "check_for_nan_in_grad"
    off = plan(make_problem(m, hw, PAR, dataclasses.replace(BASE, **{field: value})), "none",
               record=False).sim.iteration_time_s
    per_pass = grad_buffer_time(m, PAR, 0, m.num_layers, RECIPES["megatron-bf16"], hw.device) / 4
    assert on - off == pytest.approx(passes_saved * per_pass)


ARGS = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048 "
        "--micro-batch-size 2 --global-batch-size 32 --tensor-model-parallel-size 2 --sequence-parallel --bf16 "
        "--use-distributed-optimizer --vocab-size 51200")


def test_from_megatron_reads_them_and_the_export_writes_them_back() -> None:
    plain = parse_megatron_args(ARGS)
    assert plain.run.check_for_nan_in_grad and not plain.run.ddp_average_in_collective
    cmd = parse_megatron_args(ARGS + " --no-check-for-nan-in-loss-and-grad --ddp-average-in-collective")
    assert not cmd.run.check_for_nan_in_grad and cmd.run.ddp_average_in_collective
    opts = dataclasses.replace(BASE, check_for_nan_in_grad=False, ddp_average_in_collective=True)
    flags = run_flags(opts, PAR)
    assert ("--no-check-for-nan-in-loss-and-grad",) in flags and ("--ddp-average-in-collective",) in flags
    back = parse_megatron_args(ARGS + " " + " ".join(" ".join(f) for f in flags))
    assert (back.run.check_for_nan_in_grad, back.run.ddp_average_in_collective) == (False, True)
    assert not any(f[0] in ("--no-check-for-nan-in-loss-and-grad", "--ddp-average-in-collective")
                   for f in run_flags(BASE, PAR))  # Megatron's defaults: nothing to write


def test_a_plan_file_keeps_them(tmp_path: Path) -> None:
    m, hw = load_model("gpt-7b"), load_hardware(H100)
    opts = dataclasses.replace(BASE, check_for_nan_in_grad=False, ddp_average_in_collective=True)
    p = plan(make_problem(m, hw, PAR, opts), "none")
    p.save(tmp_path / "p.json")
    prob, _ = load_plan(tmp_path / "p.json")
    assert (prob.options.check_for_nan_in_grad, prob.options.ddp_average_in_collective) == (False, True)
