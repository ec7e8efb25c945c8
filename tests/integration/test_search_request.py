"""Issue 30 items 3 and 7 end to end: the pick's price equals what `lynx export <target>` shows for the plan the
search writes; pinned dimensions with --gpus derive the rest on clusters larger than the preset; pins agreeing
with --from-megatron are taken; a partition lynx printed is accepted back, interleaved too."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.harness.cli import run_main


def _json(text: str) -> dict:  # type: ignore[type-arg]
    return json.loads(text[text.index("{"):])  # type: ignore[no-any-return]


def _search(argv: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> dict:  # type: ignore[type-arg]
    code, stdout, err = run_main([*argv, "--json", "--out", str(out), "--top", "2"], capsys)
    assert code == 0, err
    return _json(stdout)


TINY_SEARCH = ["plan", "--hardware", "h100-80g-nvlink", "--gpus", "4", "--global-batch", "16", "--seq-len", "512",
               "--vpp", "1"]


@pytest.mark.parametrize(("target", "model", "row"), [("megatron", "gpt-tiny", "megatron+plugin"),
                                                      ("torchtitan", "llama-tiny", "torchtitan"),
                                                      ("lynx", "gpt-tiny", None)])
def test_pick_price_is_the_export_price(tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, model: str,
                                        row: str | None) -> None:
    plan = tmp_path / "p.json"
    d = _search([*TINY_SEARCH, "--model", model, "--target", target], plan, capsys)
    assert d["target"] == target
    w = d["winner"]
    assert w["priced_for"] == target and w["runs_on"]
    if row is None:  # lynx's own runtime: the plan's own simulation, as `lynx simulate` gives it
        code, out, err = run_main(["simulate", str(plan), "--json"], capsys)
        assert code == 0, err
        assert _json(out)["iteration_time_s"] == w["iteration_s"]
        return
    code, out, err = run_main(["export", target, str(plan), "--out", str(tmp_path / "x"), "--json"], capsys)
    assert code == 0, err
    figs = {f["label"]: f for f in _json(out)["figures"]}
    assert figs[row]["iteration_time_s"] == w["iteration_s"]
    assert [s["peak_memory_bytes"] / 2**30 for s in figs[row]["stages"]] == pytest.approx(w["stage_peak_gib"])


def test_megatron_target_ranks_lynx_plans_as_the_engine_runs_them(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Where lynx's engine inside Megatron-Core can run a lynx plan (no TransformerEngine userbuffers, local
    attention), --target megatron prices it as the engine runs it: the export's engine row, to the digit.
    --distributed-optimizer pins Megatron's DDP (the engine does not run FSDP layouts, docs/decisions/0162)."""
    plan = tmp_path / "p.json"
    d = _search([*TINY_SEARCH, "--model", "gpt-tiny", "--target", "megatron", "--method", "lynx",
                 "--no-production-overlaps", "--distributed-optimizer"], plan, capsys)
    w = d["winner"]
    assert w["runs_on"] == "Megatron-Core + lynx engine"
    code, out, err = run_main(["export", "megatron", str(plan), "--out", str(tmp_path / "x"), "--json"], capsys)
    assert code == 0, err
    engine = _json(out)["engine"]
    assert engine["runs"]
    assert engine["figures"]["iteration_time_s"] == w["iteration_s"]


def test_pinned_tp_pp_derive_dp_on_a_cluster_larger_than_the_preset(capsys: pytest.CaptureFixture[str]) -> None:
    """The preset h100-80g-nvlink has 8 nodes; --gpus 1024 --tp 8 --pp 4 used to fail its node count."""
    code, out, err = run_main(["plan", "--model", "gpt-tiny", "--hardware", "h100-80g-nvlink", "--gpus", "1024",
                               "--tp", "8", "--pp", "4", "--global-batch", "64", "--seq-len", "512", "--vpp", "1",
                               "--method", "full", "--json"], capsys)
    assert code == 0, err
    assert {(c["tp"], c["pp"], c["dp"]) for c in _json(out)["candidates"]} == {(8, 4, 32)}


@pytest.mark.slow
def test_llama_405b_on_1024_gpus_with_tp_8_pp_16(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's command: Meta's TP 8 PP 16 on 1,024 H100 (DP 8 derived)."""
    code, out, err = run_main(["plan", "--model", "llama3.1-405b", "--hardware", "h100-80g-nvlink", "--gpus", "1024",
                               "--tp", "8", "--pp", "16", "--global-batch", "1024", "--seq-len", "8192", "--top", "2",
                               "--json"], capsys)
    assert code == 0, err
    assert {(c["tp"], c["pp"], c["dp"]) for c in _json(out)["candidates"]} == {(8, 16, 8)}


def test_from_megatron_takes_pins_that_agree(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
            "--micro-batch-size 1 --global-batch-size 8 --tensor-model-parallel-size 4")
    code, _, err = run_main(["plan", "--tp", "4", "--seq-len", "512", "--from-megatron", args, "--json"], capsys)
    assert code == 0, err


LLAMA8 = ["plan", "--model", "llama3-8b", "--hardware", "h100-80g-nvlink", "--tp", "2", "--pp", "4", "--sp",
          "--micro-batch", "1", "--global-batch", "16", "--seq-len", "4096"]


@pytest.mark.parametrize("vpp", ["1", "2"])
def test_a_printed_partition_is_accepted_back(capsys: pytest.CaptureFixture[str], vpp: str) -> None:
    code, out, err = run_main([*LLAMA8, "--vpp", vpp], capsys)
    assert code == 0, err
    printed = re.search(r"partition (\S+) \(", out)
    time = re.search(r"iteration (\S+) s", out)
    assert printed and time, out
    assert ("|" in printed[1]) == (vpp != "1")
    code, again, err = run_main([*LLAMA8, "--vpp", vpp, "--layers-per-stage", printed[1]], capsys)
    assert code == 0, err
    assert f"partition {printed[1]} (explicit)" in again
    assert f"iteration {time[1]} s" in again
    # the same split in Megatron's order (virtual stages in model order) is the same partition
    if vpp != "1":
        ranks = [list(map(int, g.split(","))) for g in printed[1].split("|")]
        model_order = ",".join(str(ranks[r][c]) for c in range(int(vpp)) for r in range(len(ranks)))
        code, third, err = run_main([*LLAMA8, "--vpp", vpp, "--layers-per-stage", model_order], capsys)
        assert code == 0 and f"iteration {time[1]} s" in third, err


def test_the_search_honours_the_fusion_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """One request: a fusion flag given to the search reaches every candidate (it used to be refused)."""
    argv = [*TINY_SEARCH, "--model", "llama-tiny", "--tp", "1", "--pp", "1", "--micro-batch", "1", "--method", "none",
            "--json"]
    code, fused, err = run_main(argv, capsys)
    assert code == 0, err
    code, eager, err = run_main([*argv, "--no-rope-fusion"], capsys)
    assert code == 0, err
    assert _json(eager)["winner"]["iteration_s"] > _json(fused)["winner"]["iteration_s"]


USERBUFFERS_JOB = ["plan", "--model", "llama3-8b", "--hardware", "h100-80g-nvlink", "--precision", "megatron-bf16",
                   "--gpus", "8", "--tp", "2", "--pp", "2", "--sp", "--vpp", "1", "--micro-batch-size", "1",
                   "--distributed-optimizer", "--method", "lynx-offload", "--global-batch", "32", "--seq-len", "8192",
                   "--budget-gb", "30"]
"""A lynx-offload layout the production overlaps price with --tp-comm-overlap (SP, TP 2) where memory binds."""

def test_megatron_target_makes_a_plugin_only_lynx_plan_again_for_the_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With the production overlaps a lynx plan is priced with --tp-comm-overlap, which lynx's engine (Megatron-Core's
    local layer spec, no TransformerEngine userbuffers) cannot run: --target megatron makes it again without the flag
    where that is faster than the plugin running it with the flag. The plan file is the one priced: `lynx export
    megatron` shows the pick's figure on its engine row, to the digit (decision 0274)."""
    plan = tmp_path / "p.json"
    job = USERBUFFERS_JOB
    w = _search(job, plan, capsys)["winner"]
    assert w["runs_on"] == "Megatron-Core + lynx engine, no --tp-comm-overlap"
    text = plan.read_text()
    assert '"tp_comm_overlap": false' in text and '"overlap_param_gather": true' in text
    code, out, err = run_main(["export", "megatron", str(plan), "--out", str(tmp_path / "x"), "--json"], capsys)
    assert code == 0, err
    engine = _json(out)["engine"]
    assert engine["runs"] and engine["figures"]["iteration_time_s"] == w["iteration_s"]
    # the flag given by the user holds for every candidate: the plan keeps it and runs by the plugin
    given = _search([*job, "--tp-comm-overlap"], tmp_path / "q.json", capsys)["winner"]
    assert given["runs_on"] == "Megatron-Core + lynx plugin" and given["iteration_s"] > w["iteration_s"]
    # whose export says what the engine would run without the flag: the figure the search ranked without the user's
    code, out, err = run_main(["export", "megatron", str(tmp_path / "q.json"), "--out", str(tmp_path / "y"), "--json"],
                              capsys)
    assert code == 0, err
    assert _json(out)["engine_without_tp_comm_overlap_s"] == w["iteration_s"]


def test_lynx_target_makes_a_userbuffers_plan_again_as_lynx_train_runs_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--target lynx: lynx's own runtime issues each tensor-parallel collective whole (no TransformerEngine
    userbuffers), so a lynx plan priced with the production overlaps' --tp-comm-overlap is made again without it;
    `lynx simulate` of the plan file gives the pick's figure (decision 0274)."""
    plan = tmp_path / "p.json"
    job = [*USERBUFFERS_JOB, "--target", "lynx"]
    w = _search(job, plan, capsys)["winner"]
    assert w["runs_on"] == "lynx runtime, no --tp-comm-overlap"
    assert '"tp_comm_overlap": false' in plan.read_text()
    code, out, err = run_main(["simulate", str(plan), "--json"], capsys)
    assert code == 0, err
    assert _json(out)["iteration_time_s"] == w["iteration_s"]
