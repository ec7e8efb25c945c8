"""Megatron's gradient-buffer and optimizer-state dtypes (`cost.static_memory.OptimizerPrecision`): the recipe's
bytes, the DP reduction's bytes, and the same flags read by `lynx plan`, `--from-megatron` and written back by
`lynx export megatron`. (The DP reduction reads `recipe.grad_bytes`: `cost.dp_overlap`.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from lynx.api import plan as plan_with
from lynx.cost.static_memory import OPTIMIZER_FP32, RECIPES, OptimizerPrecision, Precision, recipe_for
from lynx.errors import SpecError
from lynx.export.megatron import build_megatron, run_flags
from lynx.export.megatron_args import parse_megatron_args
from lynx.export.megatron_optimizer import optimizer_of
from lynx.export.source import source_from
from tests.conftest import problem_for

BF16 = RECIPES[Precision.MEGATRON_BF16]
PAO = OptimizerPrecision(use_precision_aware_optimizer=True, main_grads_dtype="bf16", exp_avg_dtype="bf16",
                         exp_avg_sq_dtype="bf16")


def test_default_is_megatrons_fp32_recipe() -> None:
    assert recipe_for("megatron-bf16", None, OPTIMIZER_FP32) == BF16
    assert BF16.bytes_per_param(8, True) == pytest.approx(6 + 12 / 8)


def test_bf16_grads_and_precision_aware_state() -> None:
    grads = recipe_for("megatron-bf16", None, OptimizerPrecision(grad_reduce_in_bf16=True))
    assert (grads.grad_bytes, grads.state_bytes) == (2.0, 12.0)
    pao = recipe_for("megatron-bf16", None, PAO)
    # bf16 params, bf16 grads; main params as 16-bit remainders, bf16 moments: 2 + 2 + (2 + 2 + 2) / DP
    assert pao.bytes_per_param(8, True) == pytest.approx(4 + 6 / 8)
    whole = recipe_for("megatron-bf16", None, replace(PAO, store_param_remainders=False, exp_avg_sq_dtype="fp8"))
    assert (whole.master_bytes, whole.optimizer_bytes) == (4.0, 3.0)
    # the dtypes only change the state when the precision-aware optimizer keeps it
    ignored = recipe_for("megatron-bf16", None, replace(PAO, use_precision_aware_optimizer=False))
    assert (ignored.grad_bytes, ignored.state_bytes) == (2.0, 12.0)


def test_stage_static_memory_follows_the_dtypes() -> None:
    base = problem_for(model="gpt-7b", tp=4, pp=2, mb=1, gb=64, precision="megatron-bf16", distributed_optimizer=True)
    base = replace(base, parallel=replace(base.parallel, dp=4))
    low = replace(base, options=replace(base.options, optimizer_precision=PAO))
    a, b = base.stage_context(0, 16), low.stage_context(0, 16)
    params = a.static_bytes / (6 + 12 / 4)
    assert b.static_bytes == pytest.approx(params * (4 + 6 / 4), rel=1e-6)


def test_checks_name_the_flags() -> None:
    from lynx.checks import check_inputs

    p = problem_for(precision="paper")
    with pytest.raises(SpecError, match="--grad-reduce-in-bf16 / --main-grads-dtype .* got --precision paper"):
        check_inputs(p.model, p.hardware, p.parallel, replace(p.options, optimizer_precision=PAO))
    with pytest.raises(SpecError, match="--exp-avg-dtype 'fp64'; valid: fp32, bf16, fp16, fp8"):
        optimizer_of({"--exp-avg-dtype": "fp64"})


def test_export_writes_the_flags_and_from_megatron_reads_them_back() -> None:
    prob = problem_for(mb=4, precision="megatron-bf16", distributed_optimizer=True)
    prob = replace(prob, options=replace(prob.options, optimizer_precision=PAO))
    flags = run_flags(prob.options, prob.parallel)
    assert ("--use-precision-aware-optimizer",) in flags and ("--exp-avg-sq-dtype", "bf16") in flags
    exp = build_megatron(source_from(prob, plan_with(prob, "none").result), simulate=False)
    text = " ".join(" ".join(f) for f in exp.args)
    cmd = parse_megatron_args(text)
    assert cmd.run.optimizer_precision == PAO
    assert not any("--exp-avg-dtype" in w for w in cmd.warnings)  # read, not named as unpriced


def test_lynx_memory_takes_the_same_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """`lynx memory` breaks down the state at the dtypes `lynx plan` takes (bf16 moments, 16-bit remainders:
    (2 + 2 + 2) / DP a parameter against 12 / DP), and refuses them beside --plan like every other option."""
    import json

    from tests.harness.cli import run_main

    base = ["memory", "--method", "full", "--json", "--precision", "megatron-bf16", "--distributed-optimizer",
            "--dp", "2", "--global-batch", "128", "--nodes", "8"]
    code, out, err = run_main([*base, "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                               "--exp-avg-sq-dtype", "bf16"], capsys)
    assert code == 0, err
    st = json.loads(out)["stages"][1]
    n = sum(st["static"]["params"].values())
    assert st["static"]["optimizer_bytes"] == pytest.approx(6 * n / 2)
    code, _, err = run_main(["memory", "--plan", "p.json", "--exp-avg-dtype", "bf16"], capsys)
    assert code == 2 and "--exp-avg-dtype with --plan" in err
