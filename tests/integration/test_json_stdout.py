"""Every command and mode with `--json` prints JSON and nothing else on stdout, in a fresh process as a user
runs it: `json.loads(stdout)` must parse the whole stream. A dependency's banner (highspy 1.16 prints two lines
on descriptor 1 when the first solver object is built), a log line or a warning would break it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lynx_subprocess import run_lynx

PLAN = ["--model", "gpt-7b", "--hardware", "a100-40g-nvlink", "--tp", "4", "--pp", "4", "--micro-batch", "16",
        "--global-batch", "128", "--seq-len", "1024"]
"""The README's tight plan: HEU solves MILPs (keeping everything runs out of memory), so HiGHS is built."""
FROM_MEGATRON = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 1024 "
                 "--max-position-embeddings 1024 --micro-batch-size 16 --global-batch-size 128 "
                 "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --vocab-size 51200 "
                 "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    r = run_lynx(["plan", *PLAN, "--out", str(path)])
    assert r.returncode == 0, r.stderr
    return path


def _parses(argv: list[str]) -> object:
    r = run_lynx(argv, timeout=300)
    assert r.returncode == 0, r.stderr
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError as e:  # pragma: no cover - the failure this test exists for
        head = r.stdout[:200]
        raise AssertionError(f"stdout of lynx {' '.join(argv)} is not JSON ({e}); it starts {head!r}") from None


@pytest.mark.parametrize("argv", [
    ["plan", *PLAN, "--json"],
    ["plan", *PLAN, "--compare", "--json"],
    ["plan", "--from-megatron", FROM_MEGATRON, "--hardware", "a100-40g-nvlink", "--json"],
    ["memory", *PLAN, "--json"],
    ["graph", "--model", "gpt-7b", "--tp", "4", "--json"],
    ["schedule", "--pp", "4", "--micro-batches", "8", "--json"],
    ["methods", "--json"],
    ["presets", "--json"],
], ids=["plan", "compare", "from-megatron", "memory", "graph", "schedule", "methods", "presets"])
def test_stdout_is_json(argv: list[str]) -> None:
    assert _parses(argv)


@pytest.mark.parametrize("sub", [["simulate"], ["export", "megatron"], ["export", "torchtitan"]],
                         ids=["simulate", "export-megatron", "export-torchtitan"])
def test_plan_file_commands_print_json(plan_file: Path, tmp_path: Path, sub: list[str]) -> None:
    extra = ["--out", str(tmp_path / "out")] if sub[0] == "export" else []
    assert _parses([*sub, str(plan_file), *extra, "--json"])


def test_solve_prints_json(tmp_path: Path) -> None:
    graph = tmp_path / "g.json"
    r = run_lynx(["graph", "--model", "gpt-7b", "--tp", "4", "--micro-batch", "16", "--out", str(graph)])
    assert r.returncode == 0, r.stderr
    out = _parses(["solve", "--graph", str(graph), "--layers", "8", "--in-flight", "4", "--budget-gb", "30",
                   "--static-gb", "6", "--json"])
    assert isinstance(out, dict)
