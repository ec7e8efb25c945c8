"""`lynx plan --gpus N` end to end: the table with the stock Megatron-Core row and the explanation, every
candidate in --json, the winner's plan file that `lynx simulate` reads, and idle GPUs refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lynx.cli import app, main

runner = CliRunner()
SMALL = ["plan", "--model", "gpt-tiny", "--hardware", "a100-40g-nvlink", "--gpus", "4", "--global-batch", "16",
         "--seq-len", "512", "--vpp", "1"]


def _json(text: str) -> dict:  # type: ignore[type-arg]
    return json.loads(text[text.index("{"):])  # type: ignore[no-any-return]


def test_search_table_stock_row_and_explanation() -> None:
    r = runner.invoke(app, SMALL, terminal_width=250)
    assert r.exit_code == 0, r.output
    assert "stock Megatron-Core" in r.output
    assert "The fastest that fits is" in r.output
    assert "Searched" in r.output and "planned" in r.output


def test_search_json_lists_every_candidate_and_out_writes_a_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = runner.invoke(app, [*SMALL, "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output
    d = _json(r.stdout)
    refused = sum(r["candidates"] for r in d["refused"])  # layouts over budget on static memory alone: counted
    assert len(d["candidates"]) + d["skipped_unbuilt"] + refused == d["considered"] > 0
    assert all(c["status"] and ("iteration_s" in c or c.get("reason")) for c in d["candidates"])
    w = d["winner"]
    assert w["status"] == "planned" and w["tp"] * w["pp"] * w["dp"] == 4
    sim = runner.invoke(app, ["simulate", str(out), "--json"])
    assert sim.exit_code == 0, sim.output
    assert abs(_json(sim.stdout)["iteration_time_s"] - w["iteration_s"]) <= 1e-9 * w["iteration_s"]
    mem = runner.invoke(app, ["memory", "--plan", str(out), "--json"])
    assert mem.exit_code == 0, mem.output
    assert len(_json(mem.stdout)["stages"]) == w["pp"]


def test_pinned_dimensions_are_respected() -> None:
    r = runner.invoke(app, [*SMALL, "--tp", "2", "--micro-batch", "2", "--method", "full", "--json"])
    assert r.exit_code == 0, r.output
    d = _json(r.stdout)
    assert {(c["tp"], c["micro_batch"], c["method"]) for c in d["candidates"]} == {(2, 2, "full")}


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out + err


def test_idle_gpus_are_an_error_naming_the_product(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    code, text = _main([*SMALL, "--tp", "2", "--pp", "1", "--dp", "1", "--out", str(out)], capsys)
    assert code == 2
    assert "lynx: error: --tp 2 x --pp 1 x --dp 1 = 2 GPUs leaves 2 of the 4" in text
    assert not out.exists()
    ok = runner.invoke(app, [*SMALL, "--tp", "2", "--pp", "1", "--dp", "1", "--allow-idle-gpus", "--json"])
    assert ok.exit_code == 0, ok.output
    code, text = _main([*SMALL, "--tp", "3", "--pp", "1"], capsys)
    assert code == 2 and "does not divide the 4 GPUs" in text


@pytest.mark.parametrize("flag", ["--cp", "--pp"])
def test_one_pinned_size_not_dividing_the_gpus_is_named(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _main([*SMALL, flag, "3"], capsys)
    assert code == 2 and len(text.strip().splitlines()) == 1, text
    assert f"no layout satisfies the pinned options ({flag} 3 does not divide the 4 GPUs)" in text


def test_nodes_with_tp_pp_derives_dp() -> None:
    # a100-40g-nvlink: 4 GPUs per node; 2 nodes = 8 GPUs = TP 2 x PP 2 x DP 2.
    r = runner.invoke(app, ["plan", "--model", "gpt-tiny", "--tp", "2", "--pp", "2", "--nodes", "2",
                            "--micro-batch", "1", "--global-batch", "8", "--seq-len", "512", "--json"])
    assert r.exit_code == 0, r.output
    assert _json(r.stdout)["parallel"]["dp"] == 2


def test_search_refuses_single_layout_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _main([*SMALL, "--compare"], capsys)
    assert code == 2 and "lynx: error: --compare plans one layout" in text


def test_pins_that_leave_no_layout_are_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _main([*SMALL, "--tp", "8"], capsys)
    assert code == 2 and "lynx: error: --gpus 4: no layout satisfies the pinned options" in text


def test_search_takes_context_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    """--cp with --gpus pins CP (it used to be refused); world size TP x CP x PP x DP; the idle-GPU rule counts
    CP; a model without flash attention is refused with Megatron-Core's reason."""
    long = ["plan", "--model", "llama-tiny", "--hardware", "h100-80g-nvlink", "--gpus", "4", "--seq-len", "4096",
            "--global-batch", "8", "--method", "full", "--vpp", "1", "--json"]
    r = runner.invoke(app, [*long, "--cp", "2"])
    assert r.exit_code == 0, r.output
    d = _json(r.stdout)
    assert d["candidates"] and {c["cp"] for c in d["candidates"]} == {2}
    assert all(c["tp"] * c["cp"] * c["pp"] * c["dp"] == 4 for c in d["candidates"])
    r = runner.invoke(app, [*long, "--cp", "2", "--tp", "1", "--pp", "2"])
    assert r.exit_code == 0, r.output
    assert {(c["cp"], c["dp"]) for c in _json(r.stdout)["candidates"]} == {(2, 1)}
    code, text = _main([*long, "--cp", "2", "--tp", "1", "--pp", "1", "--dp", "1"], capsys)
    assert code == 2 and "--tp 1 x --cp 2 x --pp 1 x --dp 1 = 2 GPUs leaves 2 of the 4" in text
    code, text = _main([*SMALL, "--cp", "2"], capsys)
    assert code == 2 and "lynx: error: --gpus 4: no layout satisfies the pinned options" in text and "flash" in text


def test_search_offloads_by_default_with_a_host_link_and_no_offload_turns_it_off(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    on = runner.invoke(app, [*SMALL, "--tp", "1", "--micro-batch", "1", "--json"])
    off = runner.invoke(app, [*SMALL, "--tp", "1", "--micro-batch", "1", "--no-offload", "--json"])
    assert on.exit_code == 0 and off.exit_code == 0, (on.output, off.output)
    m_on = {c["method"] for c in _json(on.stdout)["candidates"]}
    m_off = {c["method"] for c in _json(off.stdout)["candidates"]}
    assert {"lynx-offload", "mc-offload"} <= m_on  # the A100's DGX host link (spec.default_host_link)
    assert m_on - m_off == {"lynx-offload", "mc-offload"}
    # a device lynx knows no host link for: --offload is one clear line, the default searches without it
    src = (Path(__file__).parents[2] / "src/lynx/presets/hardware/a100-40g-nvlink.yaml").read_text()
    hw = tmp_path / "nolink.yaml"
    hw.write_text(src.replace("name: A100-SXM4-40GB", "name: X1-40GB").replace("name: a100-40g-nvlink", "name: x"))
    args = ["--hardware", str(hw)]
    small = [a for a in SMALL if a not in ("--hardware", "a100-40g-nvlink")]
    code, text = _main([*small, *args, "--offload"], capsys)
    assert code == 2 and "--offload: hardware 'x' has no host link" in text
    plain = runner.invoke(app, [*small, *args, "--tp", "1", "--micro-batch", "1", "--json"])
    assert plain.exit_code == 0, plain.output
    assert not {c["method"] for c in _json(plain.stdout)["candidates"]} & {"lynx-offload", "mc-offload"}
    code, text = _main([*SMALL, "--offload", "--method", "lynx"], capsys)
    assert code == 2 and "--offload/--no-offload adds the offloading methods" in text
    code, text = _main(["plan", "--model", "gpt-tiny", "--hardware", "a100-40g-nvlink", "--tp", "1", "--pp", "2",
                        "--global-batch", "16", "--seq-len", "512", "--offload"], capsys)
    assert code == 2 and "--offload/--no-offload is read by the configuration search only" in text


def test_search_prices_megatrons_bf16_recipe_unless_told(tmp_path: Path) -> None:
    """A search ranks for a framework, so it prices the recipe the frameworks run (decision 0277): Megatron-Core's
    --bf16 (fp32 main gradients), not the paper's 16 bytes, which `lynx export megatron` would then flag. A recipe
    the user names is priced as given, with no note; the layout's peak under --bf16 holds more."""
    out = tmp_path / "plan.json"
    pinned = [*SMALL, "--tp", "2", "--pp", "2", "--micro-batch", "4", "--method", "none",
              "--no-distributed-optimizer"]
    r = runner.invoke(app, [*pinned, "--out", str(out)], terminal_width=250)
    assert r.exit_code == 0, r.output
    assert "Static memory: --precision megatron-bf16" in r.output
    assert json.loads(out.read_text())["options"]["precision"] == "megatron-bf16"
    exp = runner.invoke(app, ["export", "megatron", str(out), "--out", str(tmp_path / "mc")], terminal_width=250)
    assert exp.exit_code == 0, exp.output
    assert "--bf16" in exp.output and "precision: this plan priced the paper's" not in exp.output
    bf16 = _json(runner.invoke(app, [*pinned, "--json"]).stdout)
    paper = _json(runner.invoke(app, [*pinned, "--json", "--precision", "paper"]).stdout)
    assert (bf16["precision"], bf16["precision_defaulted"]) == ("megatron-bf16", True)
    assert (paper["precision"], paper["precision_defaulted"]) == ("paper", False)
    # 2 bytes more per parameter (fp32 main gradients) on every stage of the same layout and policy
    assert all(b > p for b, p in zip(bf16["winner"]["stage_peak_gib"], paper["winner"]["stage_peak_gib"], strict=True))
    told = runner.invoke(app, [*pinned, "--precision", "paper"], terminal_width=250)
    assert told.exit_code == 0 and "Static memory:" not in told.output


def test_torchtitan_search_names_torchtitans_own_state() -> None:
    r = runner.invoke(app, ["plan", "--model", "torchtitan-llama3-debug", "--hardware", "h100-80g-nvlink", "--gpus",
                            "2", "--global-batch", "8", "--seq-len", "512", "--target", "torchtitan"],
                      terminal_width=250)
    assert r.exit_code == 0, r.output
    assert "Static memory: --precision megatron-bf16" in r.output and "torchtitan's FSDP2 state" in r.output
