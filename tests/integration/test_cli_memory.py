"""`lynx memory` as a user runs it: table, JSON, PNG, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lynx

SRC = str(Path(lynx.__file__).resolve().parents[1])  # the lynx under test, not whatever is installed


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"COLUMNS": "220", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-m", "lynx", *args], capture_output=True, text=True, timeout=120, env=env)


def test_memory_table_json_and_png(tmp_path: Path) -> None:
    png = tmp_path / "mem.png"
    r = run("memory", "--method", "full", "--png", str(png))
    assert r.returncode == 0, r.stderr
    assert "headroom" in r.stdout and "optimizer" in r.stdout
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = run("memory", "--method", "full", "--json", "--precision", "megatron-bf16", "--distributed-optimizer",
            "--dp", "2", "--global-batch", "128", "--nodes", "8")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["method"] == "full" and len(d["stages"]) == 4
    st = d["stages"][1]
    n = sum(st["static"]["params"].values())
    assert st["static"]["optimizer_bytes"] == 12 * n / 2  # Megatron: 6 + 12/d bytes per parameter
    assert sum(st["terms_bytes"].values()) == st["peak_bytes"]
    assert st["headroom_bytes"] == st["budget_bytes"] - st["peak_bytes"]


def test_memory_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    for args, needle in [
        (("--precision", "bf16"), "--precision 'bf16'"),
        (("--png", str(tmp_path / "no" / "x.png")), "does not exist"),
        (("--busbw", "900"), "--busbw 900 GB/s"),
    ]:
        r = run("memory", *args)
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_plan_takes_the_recipe_and_busbw() -> None:
    def predict(*extra: str) -> dict[str, object]:
        r = run("plan", "--method", "full", "--json", *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["prediction"]  # type: ignore[no-any-return]

    base, bf16, slow = predict(), predict("--precision", "megatron-bf16"), predict("--busbw", "120")
    static = [s["static_bytes"] for s in base["stages"]]  # type: ignore[index]
    got = [s["static_bytes"] for s in bf16["stages"]]  # type: ignore[index]
    assert got == pytest.approx([x * 18 / 16 for x in static], rel=1e-12)
    assert slow["iteration_time_s"] > base["iteration_time_s"]  # type: ignore[operator]
