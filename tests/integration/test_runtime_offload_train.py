"""`lynx train` runs plans that offload (issue 22 item 6, docs/runtime.md): a `lynx-offload` plan trained on the
CPU (gloo, float32) gives the same losses and bitwise the same gradients as the same plan with offload removed
(offloaded ops kept), for PP, TP x PP and TP layouts; the engine's offloaded bytes per micro-batch are what the
planner's memory model says leave the device (`lynx memory`, rescaled to the runtime's dtype, plus the
LayerNorm statistics the runtime keeps), what it holds after the forwards is the prediction less them, and the
trace has the copies on their own lane."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lynx.api import make_problem  # noqa: E402
from lynx.cost.memory import layer_memory  # noqa: E402
from lynx.methods import get_method  # noqa: E402
from lynx.models import load_model  # noqa: E402
from lynx.plan import Plan, load_plan  # noqa: E402
from lynx.problem import PlanOptions  # noqa: E402
from lynx.spec import ParallelSpec, load_hardware  # noqa: E402


def offload_plan(path: Path, tp: int, pp: int, frac: float = 0.3) -> Path:
    """A `lynx-offload` plan of gpt-tiny under a budget `frac` of the way from `full`'s peak to `none`'s."""
    par = ParallelSpec(tp=tp, pp=pp, micro_batch_size=2, global_batch_size=8, seq_length=32)
    model, hw = load_model("gpt-tiny"), load_hardware("a100-40g-nvlink")
    prob = make_problem(model, hw, par, PlanOptions())

    def peak(method: str) -> float:
        res = Plan.evaluate(prob, get_method(method).fn(prob), record=False)
        return max(s.peak_memory_bytes for s in res.prediction.stages)

    lo, hi = peak("full"), peak("none")
    tight = make_problem(model, hw, par, PlanOptions(budget_bytes=lo + frac * (hi - lo)))
    Plan.evaluate(tight, get_method("lynx-offload").fn(tight)).save(path)
    return path


def hand_offload_plan(path: Path, tp: int, ops: tuple[str, ...], pp: int = 1, vpp: int = 1) -> Path:
    """A `none` plan (everything kept) whose layers offload `ops`: the runtime honours any plan that says so,
    also one the planner would not choose (PP = 1: one micro-batch in flight, offloading saves no peak)."""
    par = ParallelSpec(tp=tp, pp=pp, micro_batch_size=2, global_batch_size=8, seq_length=32)
    prob = make_problem(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), par, PlanOptions(vpp=vpp))
    Plan.evaluate(prob, get_method("none").fn(prob)).save(path)
    d = json.loads(path.read_text())
    for st in d["stages"]:
        for lay in st["layers"]:
            lay["ops"].update({o: "offload" for o in ops})
    path.write_text(json.dumps(d))
    return path


def without_offload(src: Path, dst: Path) -> Path:
    """The same plan with every offloaded op kept instead."""
    d = json.loads(src.read_text())
    for st in d["stages"]:
        for lay in st["layers"]:
            lay["ops"] = {o: ("keep" if v == "offload" else v) for o, v in lay["ops"].items()}
    dst.write_text(json.dumps(d))
    return dst


def offloads(plan: Path) -> bool:
    return any(lp.offload for pol in load_plan(str(plan))[1].policies for lp in pol.layers)


def train(plan: Path, out: Path, trace: bool = False) -> dict[str, Any]:
    argv = ["--plan", str(plan), "--iters", "2", "--warmup", "0", "--out", str(out / "r.json"), "--quiet",
            "--threads", "1"]
    if trace:
        argv += ["--trace", str(out / "t.json")]
    from lynx.runtime.config import TrainProbes
    from lynx.runtime.train import main
    from tests.harness.train_probes import SaveGrads

    out.mkdir()
    main(argv, TrainProbes(after_backward=SaveGrads(str(out / "grads"), at=1)))
    r: dict[str, Any] = json.loads((out / "r.json").read_text())
    return r


def grads(out: Path) -> dict[tuple[str, str], Any]:
    g = {}
    for f in sorted((out / "grads").glob("grads-rank*.pt")):
        for n, t in torch.load(f).items():
            g[(f.stem, n)] = t
    return g


def lynx_memory_offloaded(plan: Path) -> list[float]:
    """`lynx memory --plan P --json`: offloaded bytes per micro-batch per stage (16-bit analytic graph)."""
    from typer.testing import CliRunner

    from lynx.cli import app

    r = CliRunner().invoke(app, ["memory", "--plan", str(plan), "--json"])
    assert r.exit_code == 0, r.output
    return [st["activations"]["offloaded_per_microbatch"] for st in json.loads(r.stdout)["stages"]]


CASES = {"pp2": (1, 2), "tp2-pp2": (2, 2)}


def check_offload_run(tmp_path: Path, plan: Path) -> dict[str, Any]:
    assert offloads(plan)
    plain = without_offload(plan, tmp_path / "plain.json")
    assert not offloads(plain)
    a, b = tmp_path / "off", tmp_path / "keep"
    r_off = train(plan, a, trace=True)
    r_keep = train(plain, b)
    # the same losses, bitwise the same gradients on every rank
    assert [it["loss"] for it in r_off["iterations"]] == [it["loss"] for it in r_keep["iterations"]]
    g_off, g_keep = grads(a), grads(b)
    assert g_off and g_off.keys() == g_keep.keys()
    bad = [k for k in g_off if not torch.equal(g_off[k], g_keep[k])]
    assert not bad, bad
    # bytes: what left the device per micro-batch is the planner's figure, on every stage
    prob, res = load_plan(str(plan))
    from lynx.runtime.predict import runtime_graph

    g16 = runtime_graph(prob.graph, torch.bfloat16)  # the analytic graph's own 16-bit bytes
    mem = lynx_memory_offloaded(plan)
    pp = r_off["pp"]
    by_rank = [0.0] * pp  # virtual stage v runs on pipeline rank v % pp (interleaved 1F1B)
    for s, st in r_off["stages"].items():
        assert st["offloaded_bytes_per_microbatch"] == st["predicted_offloaded_bytes_per_microbatch"], (s, st)
        assert st["measured_act_after_fwd_bytes"] == st["predicted_act_after_fwd_bytes"], (s, st)
        assert st["measured_act_peak_bytes"] <= st["predicted_act_peak_bytes"], (s, st)
        by_rank[int(s) % pp] += st["offloaded_bytes_per_microbatch"]
        keep = r_keep["stages"][s]
        assert keep["offloaded_bytes"] == 0
        # after the forwards the device holds exactly the in-flight micro-batches' offloaded bytes less
        assert keep["measured_act_after_fwd_bytes"] - st["measured_act_after_fwd_bytes"] == \
            st["in_flight"] * st["offloaded_bytes_per_microbatch"]
        assert st["measured_host_peak_bytes"] == st["in_flight"] * st["offloaded_bytes_per_microbatch"]
    for rank in range(pp):
        assert mem[rank] == pytest.approx(sum(layer_memory(g16, lp).offloaded for lp in res.policies[rank].layers))
        if mem[rank]:  # fp32 activations (masks stay 1 byte): more than the 16-bit figure, at most twice it + stats
            assert mem[rank] < by_rank[rank] <= 2 * mem[rank] + 4096, (rank, by_rank, mem)
        else:
            assert by_rank[rank] == 0
    any_off = any(mem)
    assert any_off
    # the copies are on their own lane of the trace, out and back the same bytes
    ev = json.loads((a / "t.json").read_text())["traceEvents"]
    lanes = {(e["pid"], e["tid"]) for e in ev if e.get("cat") == "copy"}
    names = {e["args"]["name"] for e in ev if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert lanes and "copy" in names
    out = [e for e in ev if e.get("cat") == "copy" and e["name"].startswith("d2h")]
    back = [e for e in ev if e.get("cat") == "copy" and e["name"].startswith("h2d")]
    assert len(out) == len(back) > 0
    return r_off


@pytest.mark.parametrize("case", CASES)
def test_train_offload_plan_equals_keeping(tmp_path: Path, case: str) -> None:
    tp, pp = CASES[case]
    check_offload_run(tmp_path, offload_plan(tmp_path / "plan.json", tp, pp))


def test_train_tp_plan_offloading_the_last_op(tmp_path: Path) -> None:
    """TP = 2, PP = 1, a plan that offloads the layer's last op (mlp_residual: its dropout mask; its output is
    the next layer's input, counted as always stored) with others."""
    plan = hand_offload_plan(tmp_path / "plan.json", 2, ("ln1", "qkv", "fc1", "mlp_residual"))
    prob, _ = load_plan(str(plan))
    assert prob.graph.op("mlp_residual").mask_bytes > 0
    check_offload_run(tmp_path, plan)
    # the last op's mask went out and came back: its copies are in the trace
    ev = json.loads((tmp_path / "off" / "t.json").read_text())["traceEvents"]
    copies = {e["name"].split()[0] for e in ev if e.get("cat") == "copy" and " mlp_residual " in e["name"]}
    assert copies == {"d2h", "h2d"}


def test_train_interleaved_plan_offloading(tmp_path: Path) -> None:
    """PP = 2 x VPP = 2 (interleaved 1F1B, two engines per rank): honoured the same way."""
    plan = hand_offload_plan(tmp_path / "plan.json", 1, ("ln1", "qkv", "fc1", "mlp_residual"), pp=2, vpp=2)
    r = check_offload_run(tmp_path, plan)
    assert r["vpp"] == 2 and len(r["stages"]) == 4
