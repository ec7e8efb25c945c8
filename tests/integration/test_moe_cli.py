"""MoE as a user runs it: a preset planned at an EP layout, saved and exported, and the refusals of a bad layout
(one line, exit 2, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lynx_subprocess import run_lynx

QWEN_SMALL = ["--model", "qwen3-30b-a3b", "--hardware", "h100-80g-nvlink", "--tp", "1", "--pp", "2", "--dp", "4",
              "--micro-batch", "1", "--global-batch", "16", "--seq-len", "2048", "--precision", "megatron-bf16",
              "--distributed-optimizer"]


def test_plan_at_ep_saves_and_exports(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = run_lynx(["plan", *QWEN_SMALL, "--ep", "4", "--out", str(out)])
    assert r.returncode == 0, r.stderr
    assert "EP 4" in r.stdout
    d = json.loads(out.read_text())
    assert d["parallel"]["ep"] == 4 and d["model"]["num_moe_experts"] == 128
    r = run_lynx(["export", "megatron", str(out), "--out", str(tmp_path / "exp")], timeout=600)
    assert r.returncode == 0, r.stderr
    args = (tmp_path / "exp" / "megatron_args.txt").read_text()
    assert "--expert-model-parallel-size 4" in args and "--num-experts 128" in args and "--qk-layernorm" in args


@pytest.mark.parametrize(("extra", "what"), [
    (["--ep", "3", "--dp", "3", "--global-batch", "12"], "not divisible"),  # 128 experts over EP 3
    (["--ep", "8"], "must divide TP x CP x DP"),  # 8 > TP 1 x DP 4
    (["--ep", "0"], "--expert-model-parallel-size"),
])
def test_bad_expert_layouts_are_one_line(tmp_path: Path, extra: list[str], what: str) -> None:
    out = tmp_path / "plan.json"
    r = run_lynx(["plan", *QWEN_SMALL, *extra, "--out", str(out)])
    assert r.returncode == 2 and what in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("lynx: error:") and not out.exists()


@pytest.mark.parametrize("args", [
    ("--tp", "1", "--pp", "1", "--dp", "8", "--ep", "8"),
    ("--gpus", "8"),
])
def test_fsdp_with_experts_is_refused_not_mispriced(tmp_path: Path, args: tuple[str, ...]) -> None:
    """FSDP's sharded static memory knows one layer kind: an MoE model under FSDP is refused in one line."""
    out = tmp_path / "p.json"
    p = run_lynx(["plan", "--model", "qwen3-30b-a3b", "--hardware", "h100-80g-nvlink", "--global-batch", "64",
                  "--seq-len", "4096", "--use-torch-fsdp2", "--out", str(out), *args])
    assert p.returncode == 2 and "expert" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not out.exists()
