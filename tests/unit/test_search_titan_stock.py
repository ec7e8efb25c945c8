"""A search ranked for torchtitan compares its pick with torchtitan's own settings: its stock candidates are
torchtitan's activation checkpointing (none, full, per-op selective), priced as torchtitan runs them (its AC, not
lynx's engine), and torchtitan's published configuration of the model is a row of its own."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lynx.models import load_model
from lynx.search.dominance import cannot_fit, dominated
from lynx.search.evaluate import Outcome
from lynx.search.space import STOCK_METHODS, TITAN_STOCK_METHODS, Candidate, Layout, Space, Stock, method_sets
from lynx.spec import load_hardware
from tests.harness.cli import run_main

H100 = load_hardware("h100-80g-nvlink")


def test_the_torchtitan_stock_is_its_activation_checkpointing() -> None:
    titan = Space(load_model("torchtitan-llama3-8b"), H100, 8, 16, 8192, offload=True, stock=Stock.TORCHTITAN)
    assert method_sets(titan) == (("lynx", "lynx-offload"), TITAN_STOCK_METHODS)
    # torchtitan's per-op policy is priced on its own block only: a Megatron-kernel llama gets none and full
    llama = dataclasses.replace(titan, model=load_model("llama3-8b"), offload=False)
    assert method_sets(llama) == (("lynx",), ("none", "full"))
    # a pinned method is stock where the framework has it
    pinned = dataclasses.replace(titan, pins=dataclasses.replace(titan.pins, methods=("titan-sac", "selective")))
    assert method_sets(pinned) == (("selective",), ("titan-sac",))
    megatron = dataclasses.replace(titan, stock=Stock.MEGATRON, offload=False)
    assert method_sets(megatron) == (("lynx",), STOCK_METHODS)


def test_titan_sac_gives_way_to_keeping_everything_and_cannot_fit_where_full_does_not() -> None:
    lay = Layout(1, 1, 1, 8, False, 1, False, fsdp=True)
    kept = Outcome(Candidate(lay, "none", True), "planned", 1.0, iteration_s=1.0)
    assert dominated("titan-sac", {"none": kept}) == "none"
    assert dominated("titan-sac", {}) == ""
    assert "titan-sac keeps more" in cannot_fit("titan-sac", {"full"})
    assert cannot_fit("titan-sac", {"none"}) == ""


def test_the_torchtitan_search_compares_with_torchtitans_own_settings(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["plan", "--model", "torchtitan-llama3-8b", "--hardware", "h100-80g-nvlink", "--gpus",
                               "8", "--global-batch", "16", "--seq-len", "8192", "--target", "torchtitan", "--json"],
                              capsys)
    assert code == 0, err
    res = json.loads(out)
    assert "stock_megatron" not in res
    stock = res["stock_torchtitan"]
    assert stock["method"] in TITAN_STOCK_METHODS and stock["runs_on"] == "torchtitan"
    assert stock["priced_for"] == "torchtitan" and "megatron_split" not in stock
    assert {c["method"] for c in res["candidates"]} <= {"lynx", "lynx-offload", *TITAN_STOCK_METHODS}
    assert all(c["stock_torchtitan"] == (c["method"] in TITAN_STOCK_METHODS) for c in res["candidates"])
    # torchtitan's llama3_8b: TP 1, FSDP over the 8 GPUs, local batch 1, per-op SAC -- priced on torchtitan
    (recipe,) = res["recipes"]
    got = recipe["outcome"]
    assert recipe["name"] == "torchtitan llama3_8b" and "config_registry.py, llama3_8b" in recipe["source"]
    assert (got["tp"], got["pp"], got["dp"], got["fsdp"], got["micro_batch"], got["method"]) == \
        (1, 1, 8, True, 1, "titan-sac")
    assert got["priced_for"] == "torchtitan" and got["runs_on"] == "torchtitan"
    text = " ".join(res["explanation"])
    assert "The fastest stock torchtitan configuration" in text or res["winner"]["method"] in TITAN_STOCK_METHODS
    assert "The published recipe torchtitan llama3_8b" in text
    assert res["winner"]["iteration_s"] <= min(stock["iteration_s"], got["iteration_s"])


def test_a_stock_torchtitan_row_is_priced_as_the_export_prices_its_plan() -> None:
    """torchtitan runs titan-sac with its own SelectiveAC (the AC module's price); `lynx export torchtitan` of the
    same plan runs it through lynx's engine: the same recomputation, the same price."""
    from lynx.api import make_problem
    from lynx.api import plan as plan_with
    from lynx.cost.fsdp import FSDP2
    from lynx.export.source import source_from
    from lynx.export.targets import target_price
    from lynx.export.torchtitan import build_torchtitan
    from lynx.problem import PlanOptions
    from lynx.request import Target
    from lynx.spec import ParallelSpec

    par = ParallelSpec(tp=2, pp=1, dp=4, sequence_parallel=True, micro_batch_size=1, global_batch_size=16,
                       seq_length=8192)
    problem = make_problem(load_model("torchtitan-llama3-8b"), H100, par,
                           PlanOptions(precision="megatron-bf16", dp_sharding=FSDP2))
    result = plan_with(problem, "titan-sac", record=False).result
    stock = target_price(problem, result, Target.TORCHTITAN, stock=True)
    assert stock is not None and stock.runs_on == "torchtitan"
    exp = build_torchtitan(source_from(problem, result))
    assert any("activation_checkpoint=SelectiveAC.Config()" in n for n in exp.notes)  # torchtitan runs it alone
    exported = exp.figures[1]
    assert stock.figures.iteration_time_s == pytest.approx(exported.iteration_time_s, rel=1e-9)
    assert [s.peak_bytes for s in stock.figures.stages] == pytest.approx([s.peak_bytes for s in exported.stages])


def test_torchtitan_candidates_are_priced_without_megatrons_userbuffers() -> None:
    from lynx.problem import PlanOptions
    from lynx.search.options import candidate_options

    titan = Space(load_model("torchtitan-llama3-8b"), H100, 8, 16, 8192, stock=Stock.TORCHTITAN)
    sp = Layout(2, 1, 1, 4, True, 1, True)
    assert not candidate_options(PlanOptions(), titan, sp, None).tp_comm_overlap
    assert candidate_options(PlanOptions(), dataclasses.replace(titan, stock=Stock.MEGATRON), sp, None).tp_comm_overlap
    assert candidate_options(PlanOptions(tp_comm_overlap=True), titan, sp, None).tp_comm_overlap  # the user's flag


def test_a_megatron_kernel_llama_is_searched_on_torchtitans_block(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: object) -> None:
    """torchtitan runs its own block whatever the preset's kernels: with --target torchtitan every candidate of a
    llama-family model is priced on it (family torchtitan-llama3), so titan-sac is a stock candidate and the plan
    written is torchtitan's, which `lynx export torchtitan` hands to lynx's engine."""
    out = f"{tmp_path}/pick.json"
    code, stdout, err = run_main(["plan", "--model", "llama3-8b", "--hardware", "h100-80g-nvlink", "--gpus", "8",
                                  "--global-batch", "16", "--seq-len", "8192", "--target", "torchtitan", "--out", out],
                                 capsys)
    assert code == 0, err
    assert "priced on torchtitan's own block (family torchtitan-llama3" in stdout
    assert "stock torchtitan" in stdout
    plan = json.loads(Path(out).read_text())
    assert plan["model"]["family"] == "torchtitan-llama3" and plan["model"]["name"] == "llama3-8b"


def test_titan_sac_pinned_on_another_block_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """--method titan-sac on a Megatron-kernel llama ranked for Megatron: every candidate would be refused, so the
    search says why at once instead of "no configuration fits"."""
    code, _, err = run_main(["plan", "--model", "llama3-8b", "--hardware", "h100-80g-nvlink", "--gpus", "8",
                             "--global-batch", "16", "--seq-len", "8192", "--method", "titan-sac"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "--method titan-sac is priced on the torchtitan-llama3 block only" in lines[0]


def test_a_search_pinned_to_no_stock_method_says_none_was_searched(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["plan", "--model", "torchtitan-llama3-8b", "--hardware", "h100-80g-nvlink", "--gpus",
                               "8", "--global-batch", "16", "--seq-len", "8192", "--target", "torchtitan",
                               "--method", "lynx", "--json"], capsys)
    assert code == 0, err
    res = json.loads(out)
    assert res["stock_torchtitan"] is None
    assert "No stock torchtitan configuration was searched (--method pins the methods)." in res["explanation"]
