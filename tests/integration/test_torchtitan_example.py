"""examples/torchtitan/train_tp2.py as docs/export.md walks through it: plan the torchtitan Llama 3 debug preset
at TP 2, export it, launch the example with torchrun on two CPU gloo ranks; it trains through torchtitan's own
config parser with lynx's engine and its losses equal torchtitan's without lynx, bitwise; a command-line
override of SP that the plan did not make is refused in one line. Slow (two torchrun launches, each a minute on
a loaded 2-core machine): the fast representatives are test_torchtitan_checks_tp.py (the same refusal, through
the same parser, in-process ranks) and the TP parity tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torchtitan" / "train_tp2.py"
PLAN = ["--model", "torchtitan-llama3-debug", "--hardware", "h100-80g-nvlink", "--tp", "2", "--pp", "1",
        "--dp", "1", "--micro-batch", "1", "--global-batch", "2", "--seq-len", "64", "--method", "lynx",
        "--budget-gb", "0.053"]


def _lynx(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "lynx", *args], cwd=cwd, check=True, capture_output=True, text=True,
                   timeout=300)


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torchtitan")
    d = tmp_path_factory.mktemp("example")
    _lynx("plan", *PLAN, "--out", "plan.json", cwd=d)
    _lynx("export", "torchtitan", "plan.json", "--out", "lynx-torchtitan", cwd=d)
    return d / "lynx-torchtitan"


def _torchrun(export: Path, *args: str) -> subprocess.CompletedProcess[str]:
    from lynx.runtime.launch import free_port

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(EXAMPLE), str(export), *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=export.parent)


@pytest.mark.slow
def test_the_example_trains_as_torchtitan_does(export: Path) -> None:
    run = _torchrun(export, "--steps", "1", "--reference")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "bitwise equal: yes" in run.stdout, run.stdout
    windows = next(line for line in run.stdout.splitlines() if line.startswith("restored in collectives' windows"))
    assert int(windows.split(":")[1].split(",")[0]) > 0  # the plan's recomputation ran in the TP windows


@pytest.mark.slow
def test_the_example_refuses_an_sp_override(export: Path) -> None:
    run = _torchrun(export, "--steps", "1", "--parallelism.enable_sequence_parallel")
    assert run.returncode != 0
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("lynx: error:")]
    assert lines == ["lynx: error: lynx.integrations.torchtitan: sequence parallelism: the plan has no SP, the "
                     "model SP (--parallelism.enable_sequence_parallel must be what the plan was made with)"]
