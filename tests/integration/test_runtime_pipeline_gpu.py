"""PP 2 on one GPU (skipped without CUDA; CI has none): the two pipeline stages are two processes sharing
the GPU over gloo, their p2p through host memory (`HostStaged`; NCCL refuses two ranks on one GPU).

- Correctness: after one iteration, the loss and every parameter gradient equal those of a single-process,
  no-recompute CUDA run of the same model and data, float32 with TF32 off. The same kernels run on the same
  inputs (the host copies do not change a bit), so equality is bit for bit, as on the CPU; the tied
  embedding (`wte`) is the pipeline's sum of two stages' parts and is compared within a relative 1e-5.
- `lynx train --device cuda --backend gloo` runs a PP 2 plan end to end and reports, per rank, the CUDA
  allocator's peak beside the plan's per-stage peak.
- `--backend nccl` with more ranks than GPUs is refused before any process group.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _on_rank(method: str, group: object) -> dict:
    import torch.distributed as dist

    from lynx.runtime.layers.gpt import LayerConfig
    from tests.harness.pipeline_check import PipelineCase, compare_with_reference

    rank = dist.get_rank()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(rank % torch.cuda.device_count())
    cfg = LayerConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, seq_length=32,
                      micro_batch_size=2, tp=1)
    case = PipelineCase(cfg, (1, 2), pp=2, vpp=1, method=method, num_microbatches=4, host_staged=True)
    return compare_with_reference(case, rank, torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.parametrize("method", ["overlapped", "lynx"])
def test_pp2_two_processes_one_gpu_equal_to_single_process(method: str, tmp_path: Path) -> None:
    from lynx.runtime.launch import run_ranks

    out = run_ranks(functools.partial(_on_rank, method), 2, tmp_path, timeout_s=120)
    for r in out:
        assert not r["bad"], (r["rank"], r["bad"])
        assert not r["missing"] and not r["extra"] and r["num_grads"] > 0, r
        assert r["tied_rel_err"] < 1e-5, r
        assert r["param_devices"] == ["cuda"] and r["p2p_device"] == "cpu", r
    last = out[1]
    assert last["loss_equal"], (last["loss"], last["ref_loss"])
    assert sum(last["restored"]["1"].values()) > 0 or method == "lynx"
    if method == "overlapped":  # stage 0's windows host the later micro-batches' phase-1/2 work, as on CPU
        assert out[0]["restored"]["0"].get("fwd_attn") == 9, out[0]["restored"]


def _plan(path: Path, dp: int = 1) -> Path:
    from lynx.api import make_problem
    from lynx.methods import get_method
    from lynx.models import load_model
    from lynx.plan import Plan
    from lynx.problem import PlanOptions
    from lynx.spec import ParallelSpec, load_hardware

    par = ParallelSpec(tp=1, pp=2, dp=dp, micro_batch_size=2, global_batch_size=8 * dp, seq_length=64)
    prob = make_problem(load_model("gpt-tiny"), load_hardware("h100-80g-nvlink"), par, PlanOptions())
    Plan.evaluate(prob, get_method("full").fn(prob)).save(path)
    return path


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lynx.runtime.train", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("dp", [1, 2])
def test_lynx_train_pp2_on_one_gpu_over_gloo(dp: int, tmp_path: Path) -> None:
    """PP 2 (x DP 2: four processes, the DP gradient all-reduce on CUDA tensors over gloo) on one GPU."""
    plan, out = _plan(tmp_path / "plan.json", dp), tmp_path / "r.json"
    p = _train("--plan", str(plan), "--device", "cuda", "--backend", "gloo", "--iters", "2", "--warmup", "1",
               "--threads", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert (r["pp"], r["dp"], r["backend"], r["p2p"]) == (2, dp, "gloo", "host memory")
    assert all(0 < it["loss"] < 100 for it in r["iterations"])
    assert set(r["cuda_per_rank"]) == {str(k) for k in range(2 * dp)}
    for rk in r["cuda_per_rank"].values():
        assert rk["max_allocated_bytes"] > 0 and rk["predicted_peak_memory_bytes"] > 0


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="checks one GPU shared by two ranks")
def test_nccl_two_ranks_one_gpu_refused_before_any_process_group(tmp_path: Path) -> None:
    p = _train("--plan", str(_plan(tmp_path / "plan.json")), "--device", "cuda", "--backend", "nccl")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "--backend nccl: 2 ranks on this node but 1 GPU(s)" in p.stderr
