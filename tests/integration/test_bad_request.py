"""Issue 36: every bad input to the configuration search and to saved plans is one line naming the option, file
or field, exit 2, nothing written, no traceback or "internal error", and quick -- table-driven over every
command (plan, the search, --from-megatron, memory, simulate, export, train), one class of input per block:
a hang, an internal error, bad input accepted silently, a message that blamed the wrong thing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.harness.cli import run_main

TINY = ["--model", "gpt-tiny", "--hardware", "a100-40g-nvlink", "--seq-len", "512"]
SEARCH = ["plan", *TINY, "--gpus", "4", "--global-batch", "16"]
SINGLE = ["plan", *TINY, "--tp", "2", "--pp", "1", "--micro-batch", "1", "--global-batch", "2"]
MEGATRON = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
            "--micro-batch-size 1 --global-batch-size 8 --tensor-model-parallel-size 4")
NOLINK = "{f}/nolink.yaml"

CASES: list[tuple[str, list[str], str]] = [
    # a hang: counts of any size answered at once
    ("gpus-absurd", ["plan", *TINY, "--gpus", "300000000"], "--gpus 300000000"),
    ("nodes-absurd", ["plan", *TINY, "--nodes", "300000000"], "--nodes 300000000"),
    ("gpus-prime", ["plan", *TINY, "--gpus", "999983", "--global-batch", "128"], "global batch 128"),
    ("gpus-max", ["plan", *TINY, "--gpus", "1048576", "--global-batch", "128"], "global batch 128"),
    ("global-batch-absurd", [*SEARCH, "--global-batch", "1000000000000"], "--global-batch"),
    ("nodes-absurd-layout", ["plan", *TINY, "--tp", "4", "--pp", "4", "--nodes", "300000000"], "--nodes 300000000"),
    # an internal error: a saved plan read with hardware that cannot run it
    ("simulate-offload-nolink", ["simulate", "{f}/offload_nolink.json"], "no host link"),
    ("memory-offload-nolink", ["memory", "--plan", "{f}/offload_nolink.json"], "no host link"),
    ("export-megatron-offload-nolink", ["export", "megatron", "{f}/offload_nolink.json", "--out", "{o}/m"],
     "no host link"),
    ("export-titan-offload-nolink", ["export", "torchtitan", "{f}/offload_nolink.json", "--out", "{o}/t"],
     "no host link"),
    ("train-offload-nolink", ["train", "--plan", "{f}/offload_nolink.json"], "no host link"),
    ("train-optimizer-dtypes", ["train", "--plan", "{f}/bf16_grads.json"], "lynx train keeps torch AdamW's fp32"),
    ("train-compare-trace-alone", ["train", "--plan", "{f}/good.json", "--compare-trace"], "--compare-trace needs"),
    # bad input accepted silently: the search's refusals match the single layout's; options of one mode
    ("search-offload-nolink", [*SEARCH, "-H", NOLINK, "--method", "lynx-offload"], "no host link"),
    ("search-offload-flag-nolink", [*SEARCH, "-H", NOLINK, "--offload"], "no host link"),
    ("single-top", [*SINGLE, "--top", "3"], "--top is read by the configuration search only"),
    ("single-top-default-value", [*SINGLE, "--top", "5"], "--top is read by the configuration search only"),
    ("single-search-png", [*SINGLE, "--search-png", "{o}/s.png"], "--search-png is read by the configuration"),
    ("single-cross-node", [*SINGLE, "--allow-cross-node-tp"], "--allow-cross-node-tp is read by the configuration"),
    ("single-offload", [*SINGLE, "--offload"], "--offload/--no-offload is read by the configuration"),
    ("single-target", [*SINGLE, "--target", "lynx"], "--target is read by the configuration search only"),
    ("single-jobs", [*SINGLE, "--jobs", "2"], "--jobs is read by the configuration search only"),
    ("search-jobs-zero", [*SEARCH, "--jobs", "0"], "--jobs must be > 0 and <= 256, got 0"),
    ("search-jobs-huge", [*SEARCH, "--jobs", "100000"], "--jobs must be > 0 and <= 256, got 100000"),
    ("single-search-time-limit", [*SINGLE, "--search-time-limit", "60"], "--search-time-limit is read by the "
     "configuration search only"),
    ("search-time-limit-negative", [*SEARCH, "--search-time-limit", "-1"], "--search-time-limit must be >= 0"),
    ("search-time-limit-nan", [*SEARCH, "--search-time-limit", "nan"], "--search-time-limit"),
    ("single-idle", [*SINGLE, "--allow-idle-gpus"], "--allow-idle-gpus"),
    ("optimizer-dtype", [*SINGLE, "--exp-avg-dtype", "fp64"], "--exp-avg-dtype 'fp64'; valid: fp32, bf16"),
    ("optimizer-dtype-paper", [*SINGLE, "--grad-reduce-in-bf16"], "Megatron's bf16 recipe only"),
    ("search-compare", [*SEARCH, "--compare"], "--compare plans one layout only"),
    ("search-gantt", [*SEARCH, "--gantt", "{o}/g.png"], "--gantt plans one layout only"),
    ("search-lps", [*SEARCH, "--layers-per-stage", "2,2"], "--layers-per-stage plans one layout only"),
    ("search-busbw", [*SEARCH, "--busbw", "100"], "--busbw plans one layout only"),
    ("search-first-layers", [*SEARCH, "--decoder-first-pipeline-num-layers", "1"], "--decoder-first-pipeline"),
    ("search-target-typo", [*SEARCH, "--target", "megatorn"], "--target 'megatorn'"),
    ("search-target-titan-gpt", [*SEARCH, "--target", "torchtitan"], "--target torchtitan: lynx prices torchtitan's"),
    ("search-target-titan-cp", ["plan", "-m", "llama-tiny", "--gpus", "4", "--seq-len", "4096", "--global-batch", "8",
                                "--cp", "2", "--target", "torchtitan"], "--target torchtitan with --cp 2"),
    ("megatron-tp-conflict", ["plan", "--tp", "2", "--from-megatron", MEGATRON],
     "--tp 2 conflicts with --from-megatron's --tensor-model-parallel-size 4"),
    ("megatron-seq-conflict", ["plan", "--seq-len", "1024", "--from-megatron", MEGATRON],
     "--seq-len 1024 conflicts with --from-megatron's --seq-length 512"),
    ("megatron-model", ["plan", "-m", "gpt-tiny", "--from-megatron", MEGATRON],
     "--model gpt-tiny with --from-megatron"),
    ("megatron-gpus", ["plan", "--gpus", "8", "--from-megatron", MEGATRON], "--gpus"),
    ("megatron-compare", ["plan", "--compare", "--from-megatron", MEGATRON], "--compare is not read with"),
    ("megatron-not-a-file", ["plan", "--from-megatron", "{o}/args.txt"], "has no Megatron flag and is not a file"),
    ("memory-plan-and-tp", ["memory", "--plan", "{f}/good.json", "--tp", "2"], "--tp with --plan"),
    ("lps-printed-without-vpp", [*SINGLE, "--pp", "2", "--layers-per-stage", "1,1|1,1"], "--vpp 1"),
    # a message that blamed the wrong thing: the real cause named
    ("search-mb-none-allows", [*SEARCH, "--micro-batch", "3"], "--micro-batch 3 does not divide"),
    ("search-batch-not-tp", ["plan", *TINY, "--gpus", "1000", "--global-batch", "128"], "global batch 128"),
    ("search-tp-pin", [*SEARCH, "--tp", "8"], "--tp 8 does not divide the 4 GPUs"),
    # expert parallelism (issue 34): on a dense model, a pinned EP the rules refuse, a conflict with Megatron's
    ("search-ep-dense", [*SEARCH, "--ep", "2"], "--ep / --etp with --gpus: model gpt-tiny has no experts"),
    ("single-ep-dense", [*SINGLE, "--dp", "2", "--global-batch", "4", "--ep", "2"],
     "--expert-model-parallel-size 2"),
    ("search-ep-unfit", ["plan", "-m", "mixtral-8x7b", "-H", "h100-80g-nvlink", "--gpus", "16", "--tp", "2", "--pp",
                         "2", "--ep", "16", "--global-batch", "64"], "--ep 16 x ETP 2 must divide"),
    ("megatron-ep-conflict", ["plan", "--ep", "2", "--from-megatron", MEGATRON],
     "--ep 2 conflicts with --from-megatron's --expert-model-parallel-size 1"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("req")
    plan = root / "good.json"
    from lynx.cli import main

    try:
        main([*SINGLE, "--out", str(plan)])
    except SystemExit as e:
        assert not e.code, e.code
    d = json.loads(plan.read_text())
    bf16 = {**d, "options": {**d["options"], "precision": "megatron-bf16",
                             "optimizer_precision": {"grad_reduce_in_bf16": True}}}
    (root / "bf16_grads.json").write_text(json.dumps(bf16))  # priced dtypes lynx train does not run
    d["stages"][0]["layers"][0]["ops"]["fc1"] = "offload"  # a valid offloading plan on the A100's host link
    (root / "offload.json").write_text(json.dumps(d))
    d["hardware"]["device"]["name"] = "X1-40GB"  # a device lynx knows no host link for
    (root / "offload_nolink.json").write_text(json.dumps(d))
    src = (Path(__file__).parents[2] / "src/lynx/presets/hardware/a100-40g-nvlink.yaml").read_text()
    (root / "nolink.yaml").write_text(src.replace("name: A100-SXM4-40GB", "name: X1-40GB"))
    return root


@pytest.mark.parametrize(("argv", "names"), [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_request_is_one_line(files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                 names: str) -> None:
    args = [a.format(f=files, o=tmp_path) for a in argv]
    t0 = time.perf_counter()
    code, out, err = run_main(args, capsys)
    took = time.perf_counter() - t0
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("lynx: error: "), err
    assert names in lines[0], err
    assert "Traceback" not in err + out and "internal error" not in err
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # nothing written
    assert took < 5.0, f"{took:.1f} s (measured on a shared, loaded machine)"


def test_counts_answer_in_well_under_a_second(capsys: pytest.CaptureFixture[str]) -> None:
    """The hang class, timed alone (the search module already imported by the table above or here)."""
    run_main(["plan", *TINY, "--gpus", "3"], capsys)
    for argv in (["plan", *TINY, "--gpus", "300000000"], ["plan", *TINY, "--nodes", "300000000"],
                 ["plan", *TINY, "--gpus", "999983", "--global-batch", "128"]):
        t0 = time.perf_counter()
        code, _, _ = run_main(argv, capsys)
        assert code == 2 and time.perf_counter() - t0 < 1.0


def test_the_offloading_plan_reads_with_a_host_link(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The refusal above is about the link alone: the same plan on the A100 (it has one) simulates."""
    code, out, err = run_main(["simulate", str(files / "offload.json"), "--json"], capsys)
    assert code == 0, err


def test_a_trace_with_no_events_is_refused(files: Path, tmp_path: Path) -> None:
    """--compare-trace (`lynx.runtime.trace.compare`): a trace of the plan's layout without a single event."""
    from lynx.runtime.trace import TraceError, compare

    empty = tmp_path / "t.json"
    empty.write_text(json.dumps({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 0}],
                                 "otherData": {"layout": {"pp": 1, "vpp": 1, "num_microbatches": 2}}}))
    with pytest.raises(TraceError, match="no events"):
        compare(files / "good.json", empty)


def test_from_megatron_reads_a_file_as_its_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`lynx export megatron`'s megatron_args.txt (one flag a line) is read back by path, priced as quoted."""
    args = tmp_path / "megatron_args.txt"
    args.write_text(MEGATRON.replace(" --", "\n--") + "\n")
    quoted = run_main(["plan", "--from-megatron", MEGATRON, "--json"], capsys)
    by_path = run_main(["plan", "--from-megatron", str(args), "--json"], capsys)
    assert quoted[0] == by_path[0] == 0, (quoted[2], by_path[2])
    assert json.loads(by_path[1]) == json.loads(quoted[1])


def test_a_search_stopped_before_anything_fits_does_not_claim_nothing_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--search-time-limit` so short the search plans nothing: exit 3 and no plan, as when nothing fits, but the
    words say the time limit stopped it (what it left may fit), on stderr for a script reading --json, and the JSON
    says so too; not "no configuration fits the memory budget"."""
    out = tmp_path / "plan.json"
    code, stdout, err = run_main([*SEARCH, "--search-time-limit", "1e-9", "--json", "--out", str(out)], capsys)
    assert code == 3 and not out.exists()
    assert "stopped at --search-time-limit" in err and "none of the candidates planned before" in err
    assert "no configuration fits" not in err.lower()
    d = json.loads(stdout)
    assert d["stopped_at_time_limit"] and d["not_planned"] > 0 and d["winner"] is None
    assert not any("No configuration fits" in line for line in d["explanation"])
