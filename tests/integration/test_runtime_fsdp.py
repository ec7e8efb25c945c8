"""`lynx train` under torch FSDP2 (`lynx.runtime.fsdp`): a `--use-torch-fsdp2` plan at DP 2 on two gloo ranks (CPU,
float32). Each layer and the stage are `fully_shard`-ed; the engine runs each layer from the layer's own call and
restores the plan's on-demand work right after FSDP2's pre-backward all-gather of the layer (`fsdp_bwd`).

Checked, per plan: loss and every gradient shard bitwise equal to torch's own FSDP2 run of the same model, wrapped
the same way, without the engine (nothing recomputed); the full gradients (gathered) equal the DDP run's (the
runtime's flattened all-reduce) within 1e-5 relative (reduce-scatter and all-reduce sum in another order, so not
bitwise); every restoration ran inside an FSDP window, as many as the plan recomputes (at TP 1, PP 1 the plan has
no TP-collective window and no later forward to host phases 1-4, so all of its recomputation is the layers'
on-demand work, which the planner hides in the FSDP window, `cost.pricing.fsdp_window`); bytes held after forward
equal the prediction. A plan the runtime cannot run under FSDP is refused in one line, exit 2."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lynx.runtime.launch import run_ranks  # noqa: E402

PLAN = ("--model", "gpt-tiny", "--tp", "1", "--pp", "1", "--dp", "2", "--micro-batch", "2", "--global-batch", "8",
        "--seq-len", "32", "--use-torch-fsdp2")
METHODS = {"selective": (), "full": (), "lynx": ("--budget-gb", "0.035"), "uniform": ("--recompute-num-layers", "2")}
"""lynx's budget sits between none's and full's peak for gpt-tiny here: it must recompute (qkv, gelu). Megatron's
uniform chunks of 2: layer 1's (and 3's) input is not stored, so its window replays layer 0 (2) first."""


def _lynx(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lynx", *argv], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def make_plan(tmp_path: Path, method: str, *extra: str) -> Path:
    """`lynx plan` in this process (the CLI's own entry; a subprocess costs a Python start-up)."""
    from lynx.cli import main

    out = tmp_path / f"{method}.json"
    main(["plan", *PLAN, "--method", method, *METHODS.get(method, ()), *extra, "--out", str(out), "--json"])
    assert out.exists()
    return out


def _local(g: Any) -> Any:
    return g.to_local() if hasattr(g, "to_local") else g


def _full(g: Any) -> Any:
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _hook_inside_the_call(runner: Any) -> None:
    """Negative control: put lynx's window hook on each layer's output inside the layer's call, i.e. before FSDP2's
    post-forward registers its pre-backward there, so it runs before FSDP2 gathers the layer."""
    import lynx.runtime.pipeline.stages as stages
    from lynx.runtime.fsdp import window_after_pre_backward

    stages.window_after_pre_backward = lambda *a: None  # type: ignore[assignment]
    mod = runner.modules[0]
    for li, layer in enumerate(mod.layers.values()):
        def step(x: Any, mb: int, li: int = li, own: Any = layer.step) -> Any:
            y = own(x, mb)
            window_after_pre_backward(mod.engine, li, y, mb)
            return y
        layer.step = step


def _run(plan: str, group: Any, early: bool = False) -> dict[str, Any]:
    import torch.distributed as dist

    from lynx.runtime.layers.gpt_model import synthetic_batch
    from lynx.runtime.pipeline import PipelineRunner, make_groups
    from lynx.runtime.pipeline.order import layout_schedule
    from lynx.runtime.run_plan import load_run

    rank = dist.get_rank()
    rp = load_run(plan, torch.float32, False)
    layout, m = rp.layout, rp.layout.num_microbatches
    assert rp.fsdp is not None
    batches = [synthetic_batch(rp.problem.model.vocab_size, rp.cfg.micro_batch_size, rp.cfg.seq_length,
                               rank * m + j, 0) for j in range(m)]

    def runner(policies: bool, fsdp: bool) -> Any:
        lay = layout if policies else replace(layout, policies=(None,))
        r = PipelineRunner(lay, layout_schedule(1, 1, m), rp.cfg, rp.problem.model.vocab_size, rank,
                           make_groups(lay, rank), torch.device("cpu"), fsdp=rp.fsdp if fsdp else None)
        if early and policies:
            _hook_inside_the_call(r)
        r.step(batches)
        return r

    ref, ddp, got = runner(False, True), runner(False, False), runner(True, True)
    ref_grads = {n: p.grad for m_ in ref.modules.values() for n, p in m_.named_parameters()}
    got_grads = {n: p.grad for m_ in got.modules.values() for n, p in m_.named_parameters()}
    ddp_grads = {n: p.grad for m_ in ddp.modules.values() for n, p in m_.named_parameters()}
    rel = max(float((_full(got_grads[n]) - ddp_grads[n]).abs().max() / ddp_grads[n].abs().max().clamp_min(1e-30))
              for n in ddp_grads)
    stats = got.modules[0].engine.stats
    pol = layout.policies[0]
    assert pol is not None
    return {"losses": got.losses, "ref_losses": ref.losses, "ddp_losses": ddp.losses,
            "names_equal": sorted(ref_grads) == sorted(got_grads) == sorted(ddp_grads),
            "not_bitwise": sorted(n for n in ref_grads if not torch.equal(_local(got_grads[n]), _local(ref_grads[n]))),
            "sharded": all(hasattr(g, "to_local") for g in got_grads.values()),
            "rel_vs_ddp": rel, "by_window": dict(stats.by_window),
            "phases": sorted({int(p) for lp in pol.layers for _, p in lp.recompute}),
            "planned": m * sum(len(lp.recompute) for lp in pol.layers),
            "unshards": got.live[0].unshards,
            "reshard": rp.fsdp.reshard_after_forward}


def check_plan(plan: Path, tmp_path: Path, unshards: list[int] | None = None, reshard: bool = True) -> None:
    """`unshards`: per layer, how often lynx unshards it itself (a replay outside the layer's own call and
    backward); none by default."""
    for r in run_ranks(functools.partial(_run, str(plan)), 2, tmp_path, timeout_s=120):
        assert r["names_equal"] and r["sharded"] and r["reshard"] is reshard, r
        assert r["losses"] == r["ref_losses"], r
        assert r["not_bitwise"] == [], r["not_bitwise"]
        assert r["rel_vs_ddp"] < 1e-5, r["rel_vs_ddp"]
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ddp_losses"], strict=True)) < 1e-6, r
        assert r["phases"] == [5], r["phases"]  # TP 1, PP 1: the plan's recomputation is all on demand
        assert r["by_window"] == {"fsdp_bwd": r["planned"]}, (r["by_window"], r["planned"])
        assert r["unshards"] == (unshards or [0] * len(r["unshards"])), r["unshards"]


def test_fsdp2_selective_bitwise_and_restored_in_the_all_gathers(tmp_path: Path) -> None:
    check_plan(make_plan(tmp_path, "selective"), tmp_path)


@pytest.mark.parametrize("method", ["full", "lynx"])
def test_fsdp2_plans_bitwise_and_restored_in_the_all_gathers(method: str, tmp_path: Path) -> None:
    check_plan(make_plan(tmp_path, method), tmp_path)


def test_fsdp2_uniform_chunks_replay_the_layer_below_unsharded_by_lynx(tmp_path: Path) -> None:
    """Layer 1's window restores layer 0's output first, while FSDP2 holds layer 0 resharded after its forward:
    lynx unshards it (once per micro-batch; FSDP2's own pre-backward of layer 0 then finds it gathered)."""
    check_plan(make_plan(tmp_path, "uniform"), tmp_path, unshards=[2, 0, 2, 0])


def test_fsdp2_without_resharding_after_forward(tmp_path: Path) -> None:
    """reshard_after_forward off (torchtitan's `fsdp_reshard_after_forward = "never"`, read into the plan's
    `dp_sharding.reshard`): the parameters stay gathered from forward to backward; the same equalities."""
    plan = make_plan(tmp_path, "selective")
    d = json.loads(plan.read_text())
    d["options"]["dp_sharding"]["reshard"] = "never"
    plan.write_text(json.dumps(d))
    check_plan(plan, tmp_path, reshard=False)


def test_negative_control_a_window_before_fsdps_pre_backward_finds_the_layer_sharded(tmp_path: Path) -> None:
    """The hook's place matters and the checks see it: registered inside the layer's call (before FSDP2's
    pre-backward), the window runs while FSDP2 holds the layer resharded, so lynx gathers every layer itself, once
    per micro-batch (gradients still bitwise: the same replays on the same parameters)."""
    plan = make_plan(tmp_path, "selective")
    for r in run_ranks(functools.partial(_run, str(plan), early=True), 2, tmp_path, timeout_s=120):
        assert r["not_bitwise"] == [] and r["by_window"] == {"fsdp_bwd": r["planned"]}, r
        assert r["unshards"] == [2, 2, 2, 2], r["unshards"]  # check_plan requires [0, 0, 0, 0]


def test_lynx_train_fsdp2_reports_the_fsdp_windows(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, "selective")
    p = _lynx("train", "--plan", str(plan), "--iters", "1", "--warmup", "0", "--threads", "1", "--quiet",
              "--out", "r.json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["data_parallel"] == "torch-fsdp2 (reshard after forward)"
    (it,) = rep["iterations"]
    assert it["restored_on_demand"] == 0 and it["restored_in_window"] == 2 * 4 * 3  # m x layers x ops
    assert rep["stages"]["0"]["restored"] == {"fsdp_bwd": 24}
    assert rep["measured_act_after_fwd_bytes"] == rep["predicted_act_after_fwd_bytes"]


def test_lynx_train_refuses_an_fsdp_plan_it_cannot_run(tmp_path: Path) -> None:
    """The CLI path of a refusal (`check_fsdp`'s cases: tests/unit/test_runtime_fsdp_checks.py)."""
    plan = make_plan(tmp_path, "selective", "--pp", "2", "--dp", "1", "--global-batch", "4")
    p = _lynx("train", "--plan", str(plan), "--iters", "1", "--out", "r.json", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lynx: error: ") and "PP 2" in lines[0], p.stderr
    assert not (tmp_path / "r.json").exists()
