"""Bad input, table-driven: every case ends with one clear line naming the option, file or field, the
documented exit code, no traceback, and no output file touched.

Cases run in-process through `lynx.cli.main` (the real error path, not typer's test runner, which would
bypass it); a few run as a subprocess to check real exit codes, Ctrl-C and a distributed timeout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.harness.cli import run_main
from tests.integration.lynx_subprocess import TINY
from tests.integration.lynx_subprocess import run_lynx as _subprocess_lynx

SENTINEL = "pre-existing content\n"


# -- files the cases use -------------------------------------------------------------------------------------

MODEL_OK = "name: m\nnum_layers: 4\nhidden_size: 64\nnum_attention_heads: 2\n"
HW_OK = """name: hw
device: {name: d, memory_bytes: 4.0e10, peak_flops: 3.12e14, memory_bandwidth_Bps: 1.5e12}
devices_per_node: 8
intra_node: {bandwidth_Bps: 1.5e11, latency_s: 1.0e-5}
inter_node: {bandwidth_Bps: 2.5e10, latency_s: 1.0e-5}
"""


def _bomb() -> str:
    s = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for i in range(1, 9):
        s += f"{chr(97 + i)}: &{chr(97 + i)} [" + ", ".join([f"*{chr(96 + i)}"] * 9) + "]\n"
    return s + "name: *i\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 2\n"


FILES: dict[str, str | bytes] = {
    "float_layers.yaml": MODEL_OK.replace("num_layers: 4", "num_layers: 4.5"),
    "str_hidden.yaml": MODEL_OK.replace("hidden_size: 64", 'hidden_size: "64"'),
    "bool_heads.yaml": MODEL_OK.replace("num_attention_heads: 2", "num_attention_heads: true"),
    "missing.yaml": "name: m\nnum_layers: 4\nhidden_size: 64\n",
    "unknown.yaml": MODEL_OK + "hiden_size: 3\n",
    "neg_maxpos.yaml": MODEL_OK + "max_position_embeddings: -3\n",
    "neg_vocab.yaml": MODEL_OK + "vocab_size: -1\n",
    "nan_layers.yaml": MODEL_OK.replace("num_layers: 4", "num_layers: .nan"),
    "huge_layers.yaml": MODEL_OK.replace("num_layers: 4", "num_layers: 1000000000000"),
    "bomb.yaml": _bomb(),
    "binary.yaml": bytes(range(256)) * 4,
    "huge.yaml": "# " + "x" * (1 << 20) + "\n" + MODEL_OK,
    "malformed.yaml": "name: [unclosed\n",
    "list.yaml": "- 1\n- 2\n",
    "hw_nan_mem.yaml": HW_OK.replace("memory_bytes: 4.0e10", "memory_bytes: .nan"),
    "hw_inf_flops.yaml": HW_OK.replace("peak_flops: 3.12e14", "peak_flops: .inf"),
    "hw_nan_bw.yaml": HW_OK.replace("memory_bandwidth_Bps: 1.5e12", "memory_bandwidth_Bps: .nan"),
    "hw_neg_reserved.yaml": HW_OK.replace("memory_bandwidth_Bps: 1.5e12}", "memory_bandwidth_Bps: 1.5e12, "
                                          "reserved_bytes: -1}"),
    "hw_bad_link.yaml": HW_OK.replace("inter_node: {bandwidth_Bps: 2.5e10", "inter_node: {efficiency: 2, "
                                      "bandwidth_Bps: 2.5e10"),
    "hw_nan_latency.yaml": HW_OK.replace("intra_node: {bandwidth_Bps: 1.5e11, latency_s: 1.0e-5}",
                                         "intra_node: {bandwidth_Bps: 1.5e11, latency_s: .nan}"),
    "hw_str_devices.yaml": HW_OK.replace("devices_per_node: 8", "devices_per_node: eight"),
    "empty.txt": "",
    "deep.yaml": "name: " + "[" * 50000 + "]" * 50000 + "\n",
    "deep.json": "[" * 50000 + "]" * 50000,
    "many_ranks.csv": "0F0\n" * 200,
    "binary.csv": bytes(range(256)) * 4,
    "huge.csv": "0F0," * (4 << 20) + "\n",
    "exists.json": SENTINEL,
    "exists.png": SENTINEL,
    "g.txt": SENTINEL,
}


def _tamper(d: dict[str, Any], path: list[str | int], value: Any) -> dict[str, Any]:
    d = json.loads(json.dumps(d))
    obj: Any = d
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value
    return d


PLAN_TAMPERS: dict[str, tuple[list[str | int], Any]] = {
    "tp3.json": (["parallel", "tp"], 3),
    "nan_mem.json": (["hardware", "device", "memory_bytes"], math.nan),
    "neg_budget.json": (["options", "budget_bytes"], -5.0),
    "short_partition.json": (["partition", "layers_per_stage"], [1]),
    "long_partition.json": (["partition", "layers_per_stage"], [1, 1, 1]),
    "str_layers.json": (["model", "num_layers"], "4"),
    "nan_op.json": (["graph", "ops", 0, "fwd_time"], math.nan),
    "neg_bytes.json": (["graph", "ops", 1, "out_bytes"], -1.0),
    "bad_phase.json": (["stages", 0, "layers", 0, "ops", "qkv"], "recompute:9"),
    "bad_version.json": (["schema_version"], 7),
    "no_model.json": (["model"], None),
    "float_seq.json": (["parallel", "seq_length"], 64.5),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    for name, content in FILES.items():
        (root / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    (root / "adir.yaml").mkdir()
    plan = root / "good.json"
    code = _subprocess_lynx(["plan", *TINY, "--out", str(plan)]).returncode
    assert code == 0 and plan.is_file()
    d = json.loads(plan.read_text())
    for name, (path, value) in PLAN_TAMPERS.items():
        (root / name).write_text(json.dumps(_tamper(d, path, value)))
    (root / "notjson.json").write_text("{nope")
    (root / "mc.yaml").write_text("family: mcore\nname: mc\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                                  "activation: squared-relu\nvocab_size: 256\nmax_position_embeddings: 64\n")
    assert _subprocess_lynx(["plan", "--model", str(root / "mc.yaml"), "--tp", "1", "--pp", "1", "--seq-len", "32",
                             "--micro-batch", "1",
                             "--global-batch", "2", "--out", str(root / "mcore.json")]).returncode == 0
    graph = root / "graph.json"
    assert _subprocess_lynx(["graph", "--model", "gpt-tiny", "--seq-len", "64", "--out", str(graph)]).returncode == 0
    g = json.loads(graph.read_text())
    (root / "graph_nan.json").write_text(json.dumps(_tamper(g, ["ops", 2, "fwd_time"], math.nan)))
    (root / "graph_list.json").write_text("[1, 2]")
    (root / "graph_neg_input.json").write_text(json.dumps(_tamper(g, ["input_bytes"], -1.0)))
    (root / "graph_no_ops.json").write_text(json.dumps(_tamper(g, ["ops"], [])))
    return root


# -- the table: (id, argv with {f} for the files folder, exit code, what the one line must name) -------------

P = ["plan", *TINY]
SOLVE = ["solve", "--graph", "{f}/graph.json", "--layers", "2", "--in-flight", "2", "--budget-gb", "20"]
TRAIN = ["train", "--plan", "{f}/good.json"]

CASES: list[tuple[str, list[str], int, str]] = [
    # usage errors, as the CLI library reports them
    ("unknown-flag", ["plan", "--bogus-flag"], 2, "No such option"),
    ("int-not-parsed", ["plan", "--tp", "abc"], 2, "--tp"),
    ("unknown-command", ["frobnicate"], 2, "No such command"),
    ("missing-required", ["solve", "--layers", "3"], 2, "Missing option"),
    ("float-for-int", ["plan", "--pp", "4.5"], 2, "--pp"),
    # numeric options: finite and in range
    ("budget-nan", [*P, "--budget-gb", "nan"], 2, "--budget-gb"),
    ("budget-inf", [*P, "--budget-gb", "inf"], 2, "--budget-gb"),
    ("budget-neg", [*P, "--budget-gb", "-1"], 2, "--budget-gb"),
    ("budget-huge", [*P, "--budget-gb", "1e300"], 2, "--budget-gb"),
    ("bpp-nan", [*P, "--bytes-per-param", "nan"], 2, "--bytes-per-param"),
    ("bpp-neg", [*P, "--bytes-per-param", "-2"], 2, "--bytes-per-param"),
    ("time-limit-neg", [*P, "--time-limit", "-1"], 2, "--time-limit"),
    ("time-limit-nan", [*P, "--time-limit", "nan"], 2, "--time-limit"),
    ("rnl-neg", [*P, "--recompute-num-layers", "-1"], 2, "--recompute-num-layers"),
    ("seq-over-maxpos", [*P[:-2], "--seq-len", "100000000"], 2, "max_position_embeddings"),
    ("nodes-zero", [*P, "--nodes", "0"], 2, "--nodes"),
    ("tp-zero", ["plan", "--tp", "0"], 2, "--tp"),
    ("mb-neg", ["plan", "--micro-batch", "-8"], 2, "--micro-batch"),
    ("gb-indivisible", ["plan", "--global-batch", "100"], 2, "global batch"),
    ("tp-heads", ["plan", "--tp", "3"], 2, "TP 3"),
    ("lps-wrong", ["plan", "--layers-per-stage", "1,2"], 2, "--layers-per-stage"),
    ("lps-text", ["plan", "--layers-per-stage", "a,b"], 2, "--layers-per-stage"),
    ("hw-typo", ["plan", "-H", "a100-40g-nvlnk"], 2, "unknown hardware preset"),
    ("too-many-microbatches", ["plan", "--global-batch", "1048576", "--micro-batch", "1"], 2, "micro-batches"),
    ("pp-huge", ["plan", "--pp", "100000"], 2, "pp"),
    ("gb-zero", ["plan", "--global-batch", "0"], 2, "--global-batch"),
    ("dp-neg", ["plan", "--dp", "-1"], 2, "--dp"),
    ("model-typo", ["plan", "-m", "gpt-8b"], 2, "unknown model preset"),
    ("method-typo", [*P, "--method", "lynxx"], 2, "lynxx"),
    # model and hardware YAML: type, finiteness, range, fields, size, aliases
    ("yaml-float-layers", ["plan", "-m", "{f}/float_layers.yaml"], 2, "num_layers"),
    ("yaml-str-hidden", ["plan", "-m", "{f}/str_hidden.yaml"], 2, "hidden_size"),
    ("yaml-bool-heads", ["plan", "-m", "{f}/bool_heads.yaml"], 2, "num_attention_heads"),
    ("yaml-missing", ["plan", "-m", "{f}/missing.yaml"], 2, "num_attention_heads"),
    ("yaml-unknown", ["plan", "-m", "{f}/unknown.yaml"], 2, "hiden_size"),
    ("yaml-neg-maxpos", ["plan", "-m", "{f}/neg_maxpos.yaml"], 2, "max_position_embeddings"),
    ("yaml-neg-vocab", ["plan", "-m", "{f}/neg_vocab.yaml"], 2, "vocab_size"),
    ("yaml-nan-layers", ["plan", "-m", "{f}/nan_layers.yaml"], 2, "num_layers"),
    ("yaml-huge-layers", ["plan", "-m", "{f}/huge_layers.yaml"], 2, "num_layers"),
    ("yaml-alias-bomb", ["plan", "-m", "{f}/bomb.yaml"], 2, "aliases"),
    ("yaml-binary", ["plan", "-m", "{f}/binary.yaml"], 2, "binary.yaml"),
    ("yaml-huge", ["plan", "-m", "{f}/huge.yaml"], 2, "MiB"),
    ("yaml-malformed", ["plan", "-m", "{f}/malformed.yaml"], 2, "malformed YAML"),
    ("yaml-list", ["plan", "-m", "{f}/list.yaml"], 2, "mapping"),
    ("yaml-deep", ["plan", "-m", "{f}/deep.yaml"], 2, "nested too deeply"),
    ("yaml-dir", ["plan", "-m", "{f}/adir.yaml"], 2, "adir.yaml"),
    ("yaml-missing-file", ["plan", "-m", "{f}/nope.yaml"], 2, "no such model"),
    ("yaml-dev-zero", ["plan", "-m", "/dev/zero"], 2, "/dev/zero"),
    ("hw-nan-memory", ["plan", "-H", "{f}/hw_nan_mem.yaml"], 2, "memory_bytes"),
    ("hw-inf-flops", ["plan", "-H", "{f}/hw_inf_flops.yaml"], 2, "peak_flops"),
    ("hw-nan-bandwidth", ["plan", "-H", "{f}/hw_nan_bw.yaml"], 2, "memory_bandwidth_Bps"),
    ("hw-neg-reserved", ["plan", "-H", "{f}/hw_neg_reserved.yaml"], 2, "reserved_bytes"),
    ("hw-bad-link", ["plan", "-H", "{f}/hw_bad_link.yaml"], 2, "inter_node: efficiency"),
    ("hw-nan-latency", ["plan", "-H", "{f}/hw_nan_latency.yaml"], 2, "intra_node: latency_s"),
    ("hw-str-devices", ["plan", "-H", "{f}/hw_str_devices.yaml"], 2, "devices_per_node"),
    # lynx simulate re-validates a plan like lynx plan validates its inputs
    *[(f"simulate-{n[:-5]}", ["simulate", f"{{f}}/{n}"], 2, n) for n in PLAN_TAMPERS],
    ("simulate-tp3-says-why", ["simulate", "{f}/tp3.json"], 2, "TP 3"),
    ("simulate-nan-says-field", ["simulate", "{f}/nan_mem.json"], 2, "memory_bytes"),
    ("simulate-partition-says-field", ["simulate", "{f}/short_partition.json"], 2, "partition"),
    ("simulate-not-json", ["simulate", "{f}/notjson.json"], 2, "not a JSON plan"),
    ("simulate-deep-json", ["simulate", "{f}/deep.json"], 2, "nested too deeply"),
    ("simulate-missing", ["simulate", "{f}/nope.json"], 2, "no such plan"),
    ("simulate-binary", ["simulate", "{f}/binary.yaml"], 2, "binary"),
    # output paths, checked before any work
    ("out-missing-dir", [*P, "--out", "{f}/nodir/p.json"], 2, "--out"),
    ("out-is-dir", [*P, "--out", "{f}"], 2, "is a directory"),
    ("out-proc", [*P, "--out", "/proc/p.json"], 2, "/proc"),
    ("out-wrong-ext", [*P, "--out", "{f}/g.txt"], 2, ".json"),
    ("gantt-wrong-ext", [*P, "--gantt", "{f}/g.txt"], 2, ".png"),
    ("gantt-missing-dir", [*P, "--gantt", "{f}/nodir/g.png"], 2, "--gantt"),
    ("memory-png-dir", [*P, "--memory-png", "{f}"], 2, "--memory-png"),
    ("out-kept-on-bad-input", [*P, "--out", "{f}/exists.json", "--budget-gb", "nan"], 2, "--budget-gb"),
    ("simulate-gantt-ext", ["simulate", "{f}/good.json", "--gantt", "{f}/g.txt"], 2, "--gantt"),
    ("simulate-kept-on-bad-plan", ["simulate", "{f}/tp3.json", "--gantt", "{f}/exists.png"], 2, "TP 3"),
    ("graph-out-dir", ["graph", "--out", "{f}"], 2, "--out"),
    ("graph-out-ext", ["graph", "--out", "{f}/g.txt"], 2, ".json"),
    ("graph-seq", ["graph", "--seq-len", "0"], 2, "--seq-len"),
    # lynx solve
    ("solve-nan-op", [*SOLVE[:2], "{f}/graph_nan.json", *SOLVE[3:]], 2, "fwd_time"),
    ("solve-graph-list", [*SOLVE[:2], "{f}/graph_list.json", *SOLVE[3:]], 2, "graph_list.json"),
    ("solve-neg-input-bytes", [*SOLVE[:2], "{f}/graph_neg_input.json", *SOLVE[3:]], 2, "input_bytes"),
    ("solve-graph-deep", [*SOLVE[:2], "{f}/deep.json", *SOLVE[3:]], 2, "nested too deeply"),
    ("solve-budget-nan", [*SOLVE[:-1], "nan"], 2, "--budget-gb"),
    ("solve-time-limit", [*SOLVE, "--time-limit", "-1"], 2, "--time-limit"),
    ("solve-layers-zero", [*SOLVE[:3], "--layers", "0", *SOLVE[5:]], 2, "--layers"),
    ("solve-static-nan", [*SOLVE, "--static-gb", "nan"], 2, "--static-gb"),
    ("solve-backend", [*SOLVE, "--backend", "cplex"], 2, "--backend"),
    # lynx profile (no torch needed for these)
    ("profile-timeout", ["profile", "--timeout", "-5", "--no-store"], 2, "--timeout"),
    ("profile-threads", ["profile", "--threads", "-1", "--no-store"], 2, "--threads"),
    ("profile-repeats", ["profile", "--repeats", "0", "--no-store"], 2, "--repeats"),
    ("profile-db-missing-dir", ["profile", "--db", "{f}/nodir/p.sqlite"], 2, "--db"),
    ("profile-db-not-ours", ["profile", "--db", "{f}/exists.json"], 2, "exists.json"),
    ("profile-export-out", ["profile", "export", "latest", "--db", "{f}/p.sqlite", "--out", "{f}/x.txt"], 2,
     ".json"),
    # lynx schedule, lynx memory and lynx export
    ("vpp-negative", [*P, "--vpp", "-1"], 2, "vpp"),
    ("vpp-without-pp", [*P, "--pp", "1", "--vpp", "2"], 2, "--vpp"),
    ("schedule-pp-zero", ["schedule", "--pp", "0", "--micro-batches", "4"], 2, "pp"),
    ("schedule-interleaved-m", ["schedule", "--pp", "4", "--micro-batches", "6", "--vpp", "2"], 2, "multiple"),
    ("memory-png-proc", ["memory", "--png", "/proc/m.png"], 2, "/proc"),
    ("memory-png-ext", ["memory", "--png", "{f}/g.txt"], 2, ".png"),
    ("memory-busbw-nan", ["memory", "--tp", "4", "--busbw", "nan"], 2, "--busbw"),
    ("precision-bogus", [*P, "--precision", "bogus"], 2, "--precision"),
    ("export-missing-plan", ["export", "megatron", "{f}/nope.json"], 2, "nope.json"),
    ("export-out-proc", ["export", "torchtitan", "{f}/good.json", "--out", "/proc/x"], 2, "/proc"),
    ("export-out-is-file", ["export", "megatron", "{f}/good.json", "--out", "{f}/exists.json"], 2, "not a directory"),
    ("from-megatron-bad-int", [*P, "--from-megatron", "--num-layers abc"], 2, "--num-layers"),
    ("budget-below-static", ["plan", "--model", "gpt-tiny", "--tp", "1", "--pp", "4", "--micro-batch", "2",
                             "--global-batch", "32", "--seq-len", "512", "--budget-gb", "0.05"], 2,
     "no recomputation policy fits"),
    # the surfaces added since: schedule CSVs, lynx schedule's own ranges and output, lynx solve's sizes
    ("schedule-load-many-ranks", ["schedule", "--load", "{f}/many_ranks.csv"], 2, "at most 128 ranks"),
    ("schedule-load-binary", ["schedule", "--load", "{f}/binary.csv"], 2, "binary.csv"),
    ("schedule-load-huge", ["schedule", "--load", "{f}/huge.csv"], 2, "larger than 16 MiB"),
    ("schedule-load-dir", ["schedule", "--load", "{f}/adir.yaml"], 2, "not a regular file"),
    ("simulate-schedule-huge", ["simulate", "{f}/good.json", "--schedule", "{f}/huge.csv"], 2, "huge.csv"),
    ("schedule-micro-batches-huge", ["schedule", "--micro-batches", "100000"], 2, "--micro-batches"),
    ("schedule-pp-huge", ["schedule", "--pp", "400"], 2, "--pp"),
    ("schedule-csv-ext", ["schedule", "--csv", "{f}/g.txt"], 2, ".csv"),
    ("schedule-csv-missing-dir", ["schedule", "--csv", "{f}/nodir/s.csv"], 2, "--csv"),
    ("solve-no-ops", [*SOLVE[:2], "{f}/graph_no_ops.json", *SOLVE[3:]], 2, "no ops"),
    ("solve-in-flight-huge", [*SOLVE[:5], "--in-flight", "100000000", *SOLVE[7:]], 2, "--in-flight"),
    ("solve-layers-huge", [*SOLVE[:3], "--layers", "100000000", *SOLVE[5:]], 2, "--layers"),
    ("solve-microbatches-huge", [*SOLVE, "--microbatches", "100000000"], 2, "--microbatches"),
]

TRAIN_CASES: list[tuple[str, list[str], int, str]] = [
    ("train-timeout-neg", [*TRAIN, "--timeout", "-5"], 2, "--timeout"),
    ("train-iters-zero", [*TRAIN, "--iters", "0"], 2, "--iters"),
    ("train-empty-data", [*TRAIN, "--data", "{f}/empty.txt"], 2, "--data"),
    ("train-missing-data", [*TRAIN, "--data", "{f}/nope.txt"], 2, "--data"),
    ("train-out-missing-dir", [*TRAIN, "--out", "{f}/nodir/r.json"], 2, "--out"),
    ("train-out-ext", [*TRAIN, "--out", "{f}/g.txt"], 2, ".json"),
    ("train-device", [*TRAIN, "--device", "gpu"], 2, "--device"),
    ("train-backend", [*TRAIN, "--backend", "mpi"], 2, "--backend"),
    ("train-nccl-on-cpu", [*TRAIN, "--device", "cpu", "--backend", "nccl"], 2, "--backend nccl needs --device cuda"),
    ("train-tampered-plan", ["train", "--plan", "{f}/tp3.json"], 2, "TP 3"),
    ("train-family-without-runtime", ["train", "--plan", "{f}/mcore.json"], 2, "mcore family's MoE layer only"),
    ("train-trace-ext", [*TRAIN, "--trace", "{f}/g.txt"], 2, "--trace"),
    ("train-trace-proc", [*TRAIN, "--trace", "/proc/t.json"], 2, "/proc"),
    ("train-threads-huge", [*TRAIN, "--threads", "100000"], 2, "--threads"),
    ("train-iters-huge", [*TRAIN, "--iters", "100000000"], 2, "--iters"),
    ("train-schedule-huge", [*TRAIN, "--schedule", "{f}/huge.csv"], 2, "larger than 16 MiB"),
    ("train-missing-plan-with-trace", ["train", "--plan", "{f}/nope.json", "--trace", "{f}/t.json"], 2,
     "no such plan file"),
]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}


def _check(case: tuple[str, list[str], int, str], files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, argv, want_code, names = case
    before = _snapshot(files)
    code, out, err = run_main([a.replace("{f}", str(files)) for a in argv], capsys)
    assert code == want_code, (code, out, err)
    assert "Traceback" not in out + err and "frame #" not in err, err
    lines = err.strip().splitlines()
    if lines and lines[-1].startswith("Error:"):  # a usage error: usage, a hint, then one error line
        assert names in lines[-1], err
    else:
        assert len(lines) == 1 and lines[0].startswith("lynx: error: "), err
        assert names in lines[0], err
    assert _snapshot(files) == before, "an input or output file changed"
    assert not (files / "nodir").exists()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case: tuple[str, list[str], int, str], files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _check(case, files, capsys)


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_bad_train_input(case: tuple[str, list[str], int, str], files: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    _check(case, files, capsys)


@pytest.mark.parametrize(("env", "names"), [
    ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK 5 must be below WORLD_SIZE 2"),
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc'"),
    ({"RANK": "0"}, "RANK and WORLD_SIZE go together"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT not set"),
    ({"LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE='x'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, "MASTER_PORT=99999"),
], ids=["rank-above-world", "rank-not-int", "rank-alone", "no-master", "local-world-not-int", "port-range"])
def test_bad_launcher_environment(env: dict[str, str], names: str, files: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """torchrun's variables checked before any process group: one line naming the variable, exit 2."""
    pytest.importorskip("torch")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _check(("env", ["train", "--plan", "{f}/good.json"], 2, names), files, capsys)


def test_cuda_requested_on_a_machine_without_one(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--device cuda` where torch sees no GPU: one line before any process group, not a rank's traceback."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for extra in ([], ["--backend", "gloo"]):
        _check(("train-cuda-absent", [*TRAIN, "--device", "cuda", *extra], 2, "--device cuda: no CUDA device"),
               files, capsys)


def test_compare_when_nothing_fits(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No method fits: the table still prints, one line says so, and the exit code is 3 for scripts."""
    code, out, err = run_main(["plan", "--compare", "--budget-gb", "1", "--out", f"{files}/exists.json"], capsys)
    assert code == 3 and "no method fits" in err and "full" in out
    assert (files / "exists.json").read_text() == SENTINEL


def test_internal_error_is_one_line_and_debug_shows_traceback(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    import lynx.api

    def boom(*_: object, **__: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(lynx.api, "plan", boom)
    monkeypatch.setenv("LYNX_DEBUG", "0")  # `--debug` below sets it for the process; restored afterwards
    code, _, err = run_main([*P], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "internal error" in err and "ZeroDivisionError" in err and "report" in err and "--debug" in err
    assert "Traceback" not in err
    code, _, err = run_main([*P, "--debug"], capsys)
    assert code == 1 and "Traceback" in err and "internal error" in err.strip().splitlines()[-1]


def test_interrupt_exits_130_and_writes_nothing(monkeypatch: pytest.MonkeyPatch, files: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import lynx.api

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(lynx.api, "plan", interrupted)
    code, _, err = run_main([*P, "--out", f"{files}/exists.json"], capsys)
    assert code == 130 and err.strip() == "lynx: interrupted"
    assert (files / "exists.json").read_text() == SENTINEL


def test_failed_write_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted half-way through writing: the previous file is intact and no temporary file is left."""
    from lynx.paths import write_text

    target = tmp_path / "p.json"
    target.write_text(SENTINEL)
    real = Path.write_text

    def half_then_interrupt(self: Path, data: str, *a: Any, **k: Any) -> int:
        real(self, data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_text(target, '{"a": 1}', "--out")
    monkeypatch.undo()
    assert target.read_text() == SENTINEL and sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]
