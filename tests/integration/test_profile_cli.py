"""`lynx profile` end to end on this CPU: measure (TP 1 in process, TP 2 as two gloo processes on
127.0.0.1), store, list/show/export, plan from the stored profile, calibrate; and the bad-input paths
(unreachable rendezvous, corrupt database) end in one clear line with exit code 2, quickly."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

LYNX = [sys.executable, "-c", "from lynx.cli import main; main()"]
TINY = ["--model", "gpt-tiny", "--micro-batch", "2", "--seq-len", "128", "--device", "cpu"]


def lynx(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LYNX, *args], capture_output=True, text=True, timeout=timeout,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "p.sqlite"
    r = lynx("profile", *TINY, "--tp", "1", "--repeats", "4", "--warmup", "1", "--db", str(path))
    assert r.returncode == 0, r.stderr
    assert "stored as profile 1" in r.stdout
    return path


def test_profile_list_show_export(db: Path) -> None:
    rows = json.loads(lynx("profile", "list", "--db", str(db), "--json").stdout)
    assert rows[0]["id"] == 1 and rows[0]["hidden_size"] == 256 and rows[0]["tp"] == 1
    shown = json.loads(lynx("profile", "show", "1", "--db", str(db), "--json").stdout)
    assert shown["extra"]["saved_mismatch"] == []
    graph = json.loads(lynx("profile", "export", "latest", "--db", str(db), "--graph-only").stdout)
    assert graph["meta"]["source"] == "profile:1" and len(graph["ops"]) == 15


def test_plan_from_the_stored_profile(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = lynx("plan", "--profile", "1", "--db", str(db), "--model", "gpt-tiny", "--tp", "1", "--pp", "2",
             "--micro-batch", "2", "--seq-len", "128", "--global-batch", "8", "--out", str(out))
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    assert plan["graph"]["meta"]["source"] == "profile:1"
    stored = json.loads(lynx("profile", "export", "1", "--db", str(db), "--graph-only").stdout)
    assert plan["graph"]["ops"] == stored["ops"]  # the planner used the measured graph as stored
    layer = sum(o["fwd_time"] for o in stored["ops"])
    # two layers per stage, measured times: the stage forward is built from them, not the analytic model
    assert plan["prediction"]["stages"][0]["fwd_time_s"] == pytest.approx(2 * layer, rel=0.05)
    # a layout the profile does not describe is refused
    r = lynx("plan", "--profile", "1", "--db", str(db), "--model", "gpt-tiny", "--tp", "1", "--pp", "2",
             "--micro-batch", "4", "--seq-len", "128", "--global-batch", "8")
    assert r.returncode == 2 and "does not match" in r.stderr


def test_calibrate_reports_before_and_after(db: Path) -> None:
    r = lynx("profile", "calibrate", "1", "--db", str(db), "--json")
    assert r.returncode == 0, r.stderr
    cal = json.loads(r.stdout)
    assert cal["error_after"] <= cal["error_before"]
    assert {o["name"] for o in cal["ops"]} >= {"qkv", "fc1", "softmax"}


def test_custom_shape_from_the_command_line(tmp_path: Path) -> None:
    r = lynx("profile", "--model", "gpt-tiny", "--hidden", "128", "--heads", "4", "--seq-len", "64",
             "--micro-batch", "1", "--repeats", "2", "--warmup", "0", "--device", "cpu",
             "--db", str(tmp_path / "c.sqlite"), "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    meta = rec["graph"]["meta"]
    assert (meta["hidden_size"], meta["num_attention_heads"], meta["ffn_hidden_size"]) == (128, 4, 512)
    assert rec["info"]["model"] == "gpt-tiny[h128,a4,f512]" and rec["extra"]["saved_mismatch"] == []
    assert rec["graph"]["ops"][1]["out_bytes"] == 64 * 1 * 3 * 128 * 4  # qkv, fp32


def test_tp2_two_gloo_processes() -> None:
    from lynx.profile.profiler import ProfileConfig, profile

    t0 = time.monotonic()
    res = profile(ProfileConfig("gpt-tiny", 256, 8, 1024, 128, 2, tp=2, repeats=3, warmup=1), timeout_s=30)
    assert time.monotonic() - t0 < 60
    g = res.graph
    assert g.meta.tp == 2 and res.extra["saved_mismatch"] == []
    assert g.op("qkv").out_bytes == 128 * 2 * 3 * 256 / 2 * 4  # column-parallel: a third of 3h per rank
    assert g.op("attn_allreduce").fwd_time > 0 and g.op("mlp_allreduce").bwd_time > 0
    assert res.extra["split"]["attn_allreduce"] == "comm"


def test_unreachable_rendezvous_is_a_clear_error_not_a_hang() -> None:
    from lynx.profile.errors import ProfileError
    from lynx.profile.profiler import ProfileConfig, profile

    t0 = time.monotonic()
    with pytest.raises(ProfileError, match="cannot reach the rendezvous tcp://10.255.255.1:29517") as e:
        profile(ProfileConfig("gpt-tiny", 256, 8, 1024, 128, 2, tp=2, device="cpu"),
                rendezvous="10.255.255.1:29517", timeout_s=1)
    assert "\n" not in str(e.value)
    assert time.monotonic() - t0 < 60


def test_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.sqlite"
    bad.write_bytes(b"not a database" * 64)
    for args in (["profile", "list", "--db", str(bad)],
                 ["profile", "--model", "gpt-300m", "--hidden", "16384", "--heads", "128", "--seq-len", "65536",
                  "--micro-batch", "64", "--device", "cpu", "--no-store"]):
        r = lynx(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith("lynx: error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert bad.read_bytes() == b"not a database" * 64
