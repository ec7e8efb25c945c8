"""FP8 through the user's paths: --from-megatron prices the FP8 flags, `lynx export megatron` writes them back,
plan files keep them, and what lynx cannot price is one `lynx: error:` line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lynx.api import make_problem
from lynx.api import plan as plan_with
from lynx.cli.app import app
from lynx.errors import SpecError
from lynx.export.megatron import build_megatron
from lynx.export.megatron_args import parse_megatron_args
from lynx.export.pricing import imported_problem, simulate_stock
from lynx.export.source import source_from
from lynx.fp8 import Fp8, Fp8Format, Fp8Recipe
from lynx.models import load_model
from lynx.plan import Plan, load_plan
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec, load_hardware
from tests.harness.cli import run_main

LLAMA = ("pretrain_gpt.py --num-layers 8 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
         "--group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 8192 "
         "--vocab-size 128256 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
         "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 "
         "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
         "--micro-batch-size 1 --global-batch-size 16 --bf16 --use-distributed-optimizer")
FP8 = " --fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather --fp8-amax-history-len 1024"


def _stock(args: str) -> tuple[float, tuple[str, ...]]:
    """(iteration s, the layer graph's ops) of stock Megatron on the command line."""
    cmd = parse_megatron_args(args)
    prob = imported_problem(cmd.model, cmd.parallel(2), cmd.layout, "h100-80g-nvlink",
                            PlanOptions(distributed_optimizer=True, precision="megatron-bf16"))
    fig = simulate_stock(prob, cmd.layout, cmd.recompute)
    assert fig.plan is not None
    return fig.plan.sim.iteration_time_s, prob.graph.names


def test_from_megatron_with_fp8_flags_prices_fp8() -> None:
    cmd = parse_megatron_args(LLAMA + FP8)
    assert cmd.model.fp8 == Fp8(Fp8Format.HYBRID, Fp8Recipe.TENSORWISE, param_gather=True)
    assert not any("--fp8" in w for w in cmd.warnings)  # read, not "ignored"
    assert parse_megatron_args(LLAMA).model.fp8 is None
    (bf16, ops16), (fp8, ops8) = _stock(LLAMA), _stock(LLAMA + FP8)
    assert "qkv_fp8" in ops8 and "qkv_fp8" not in ops16
    assert fp8 < bf16  # the GEMMs at the FP8 rate, less the quantize passes


@pytest.mark.parametrize("flag", ["--first-last-layers-bf16", "--no-fp8-wgrad", "--fp8-dot-product-attention",
                                  "--fp4-format e2m1"])
def test_fp8_flags_lynx_cannot_price_are_refused_not_ignored(flag: str) -> None:
    with pytest.raises(SpecError, match=f"{flag.split()[0]} .*not modelled"):
        parse_megatron_args(LLAMA + FP8 + " " + flag)


def test_export_writes_the_fp8_flags_and_reads_them_back(tmp_path: Path) -> None:
    m = replace(load_model("llama3-8b"), num_layers=8, fp8=Fp8(Fp8Format.E4M3, Fp8Recipe.BLOCKWISE, True))
    par = ParallelSpec(tp=2, pp=2, dp=2, sequence_parallel=True, micro_batch_size=1, global_batch_size=16,
                       seq_length=4096)
    prob = make_problem(m, load_hardware("h100-80g-nvlink"), par,
                        PlanOptions(distributed_optimizer=True, precision="megatron-bf16"))
    p = plan_with(prob, "lynx", record=False)
    text = build_megatron(source_from(p.problem, p.result)).args_text()
    assert "--fp8-format e4m3" in text and "--fp8-recipe blockwise" in text and "--fp8-param-gather" in text
    assert parse_megatron_args(text).model.fp8 == m.fp8
    p.save(tmp_path / "p.json")  # the plan file keeps the setting
    again = Plan.evaluate(*load_plan(tmp_path / "p.json"), record=False)
    assert again.problem.model.fp8 == m.fp8
    assert again.sim.iteration_time_s == pytest.approx(p.sim.iteration_time_s)


@pytest.mark.parametrize("args, says", [
    (["--fp8-format", "e5m2"], "--fp8-format 'e5m2'; valid: hybrid, e4m3"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], "Blackwell"),
    (["--fp8-param-gather"], "needs --fp8-format"),
    (["--fp8-format", "hybrid", "--hardware", "a100-80g-dgx"], "no FP8 tensor cores"),
])
def test_bad_fp8_options_are_one_line_and_exit_2(args: list[str], says: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "llama3-8b", "--hardware", "h100-80g-nvlink", "--tp", "2", "--pp", "2",
            "--micro-batch", "1", "--global-batch", "16", "--seq-len", "4096", "--method", "none"]
    code, out, err = run_main([*base, *args], capsys)
    assert code == 2 and out == "", (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("lynx: error:") and says in lines[0], err


def test_lynx_memory_and_plan_show_the_fp8_setting() -> None:
    base = ["--model", "llama3-8b", "--hardware", "h100-80g-nvlink", "--tp", "2", "--pp", "2", "--micro-batch", "1",
            "--global-batch", "16", "--seq-len", "4096", "--method", "none", "--fp8-format", "hybrid"]
    r = CliRunner().invoke(app, ["memory", *base, "--json"])
    assert r.exit_code == 0, r.output
    assert "FP8 hybrid delayed" in r.output
    r = CliRunner().invoke(app, ["plan", *base])
    assert r.exit_code == 0, r.output
    assert "FP8 hybrid delayed" in r.output
