"""Faults and real exit codes, as a user meets them (subprocesses): usage errors, Ctrl-C during a HiGHS
solve, a rendezvous nobody answers, a local rank that dies. Subprocess timeouts only guard against hangs;
no wall time is asserted."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.train_probes import probe_command, probe_env
from tests.integration.lynx_subprocess import TINY
from tests.integration.lynx_subprocess import run_lynx as _subprocess_lynx


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    r = _subprocess_lynx(["plan", *TINY, "--out", str(root / "good.json")])
    assert r.returncode == 0, r.stderr
    return root


@pytest.mark.parametrize(("argv", "code", "needle"), [
    (["plan", "--bogus-flag"], 2, "--bogus-flag"),  # click words it "No such option: X" or "No such option 'X'"
    (["frobnicate"], 2, "No such command"),
    (["plan", "--budget-gb", "nan"], 2, "lynx: error: --budget-gb"),
])
def test_subprocess_exit_codes(argv: list[str], code: int, needle: str) -> None:
    r = _subprocess_lynx(argv)
    assert r.returncode == code and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_ctrl_c_during_a_milp_solve_exits_130(tmp_path: Path) -> None:
    """SIGINT once HiGHS is searching (its progress line is on stderr): exit 130, one line, no plan file."""
    out = tmp_path / "p.json"
    env = {**os.environ, "COLUMNS": "200"}
    p = subprocess.Popen([sys.executable, "-m", "lynx", "plan", "--model", "gpt-13b", "--method", "lynx-opt",
                          "--time-limit", "300", "--out", str(out)], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.stderr is not None
    for line in p.stderr:
        if "HiGHS:" in line:
            break
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == "lynx: interrupted" and "Traceback" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_closed_stdout_still_writes_the_plan(tmp_path: Path) -> None:
    """`lynx plan ... --out p.json | head`: the reader is gone before lynx prints anything (the pipe's read end
    is closed at once), yet the plan file is written whole; one line on stderr says the output was cut, exit 1
    (an input/output failure), no traceback."""
    out = tmp_path / "p.json"
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("LYNX_DEBUG", None)
    r_fd, w_fd = os.pipe()
    os.close(r_fd)  # no reader: lynx's first write to stdout gets EPIPE
    try:
        r = subprocess.run([sys.executable, "-m", "lynx", "plan", *TINY, "--out", str(out)], stdout=w_fd,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    finally:
        os.close(w_fd)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("lynx: standard output was closed early")
    assert json.loads(out.read_text())["prediction"]


def test_unreachable_rendezvous_fails_with_one_line(files: Path) -> None:
    """A rank whose rendezvous never answers: one line naming the address and --timeout, no C++ frames,
    exit 1. (The subprocess timeout only guards against a hang; no wall time is asserted.)"""
    pytest.importorskip("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    r = _subprocess_lynx(["train", "--plan", f"{files}/good.json", "--timeout", "3", "--iters", "1"], env, 90)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not join the process group" in lines[0] and "--timeout 3" in lines[0], lines
    assert f"127.0.0.1:{port}" in lines[0]


def test_a_dying_local_rank_is_one_line_per_rank_and_exit_1(files: Path) -> None:
    """TP 2 spawned locally, rank 1 vanishes mid-run: lynx's lines only (rank 0's, the launcher's), no
    traceback, no torch log lines or C++ frames, exit 1 (a fault, not bad input)."""
    pytest.importorskip("torch")
    e = {**os.environ}
    e.pop("LYNX_DEBUG", None)
    r = subprocess.run(probe_command(["--die-at", "1", "--die-rank", "1"],
                                     ["--plan", f"{files}/good.json", "--iters", "3", "--timeout", "10", "--threads",
                                      "1", "--quiet"]), capture_output=True, text=True, timeout=120, env=probe_env(e))
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines and all(x.startswith(("lynx train: rank", "lynx: error: training failed")) for x in lines), lines
    assert "exit code 17" in lines[-1]
