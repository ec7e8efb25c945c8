"""Mixed precision (`lynx train --precision megatron-bf16`): bf16 autocast over fp32 master weights. On the CPU:
it trains, parameters, gradients and AdamW state stay fp32, autocast is really on (the gradients differ from
the fp32 run's), and recomputation replays under the forward's autocast state, so every policy's gradients
are bitwise equal to the no-recompute bf16 run's. The exact-gradient tests elsewhere stay fp32."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lynx.runtime.launch import run_ranks  # noqa: E402
from lynx.runtime.layers.gpt import LayerConfig  # noqa: E402
from lynx.runtime.layers.gpt_model import synthetic_batch  # noqa: E402
from lynx.runtime.pipeline import PipelineRunner, make_groups  # noqa: E402
from tests.harness.pipeline_check import PipelineCase  # noqa: E402

CFG = LayerConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, seq_length=16, micro_batch_size=2,
                  dropout_p=0.1)


def _grads(case: PipelineCase, autocast: Any) -> tuple[dict[str, Any], set[str]]:
    import torch.distributed as dist

    layout = case.layout()
    runner = PipelineRunner(layout, case.schedule(), case.cfg, case.vocab, dist.get_rank(),
                            make_groups(layout, dist.get_rank()), torch.device("cpu"), autocast=autocast)
    batches = [synthetic_batch(case.vocab, CFG.micro_batch_size, CFG.seq_length, j, 0)
               for j in range(case.num_microbatches)]
    runner.step(batches)
    dtypes = {str(p.dtype) for p in runner.parameters()} | {str(p.grad.dtype) for p in runner.parameters()}
    return runner.named_grads(), dtypes


def _compare(group: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = PipelineCase(CFG, (3,), 1, 1, "none", 3)
    ref, dtypes = _grads(base, torch.bfloat16)
    fp32, _ = _grads(base, None)
    out["master_dtypes"] = sorted(dtypes)
    out["differs_from_fp32"] = any(not torch.equal(ref[n], fp32[n]) for n in ref)
    for method in ("full", "selective", "overlapped"):
        got, _ = _grads(PipelineCase(CFG, (3,), 1, 1, method, 3), torch.bfloat16)
        out[method] = sorted(n for n in ref if not torch.equal(got[n], ref[n]))
    return out


def test_bf16_autocast_recomputes_bitwise_with_fp32_master_weights(tmp_path: Path) -> None:
    (r,) = run_ranks(functools.partial(_compare), 1, tmp_path)
    assert r["master_dtypes"] == ["torch.float32"], r
    assert r["differs_from_fp32"], "autocast did not change the computation"
    for method in ("full", "selective", "overlapped"):
        assert r[method] == [], (method, r[method])


def _lynx(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lynx", *argv], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def test_lynx_train_megatron_bf16_runs_and_keeps_fp32_master_weights(tmp_path: Path) -> None:
    p = _lynx("plan", "--model", "gpt-tiny", "--tp", "1", "--pp", "1", "--micro-batch", "2", "--global-batch", "4",
              "--seq-len", "32", "--method", "selective", "--out", "p.json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    p = _lynx("train", "--plan", "p.json", "--iters", "2", "--warmup", "0", "--threads", "1",
              "--precision", "megatron-bf16", "--out", "r.json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "note: the predictions are Megatron's bf16 model's" in p.stdout, p.stdout  # autocast holds more
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["precision"] == "megatron-bf16"
    assert rep["master_dtypes"] == {"params": ["torch.float32"], "grads": ["torch.float32"],
                                    "optimizer": ["torch.float32"]}
    assert all(it["loss"] == it["loss"] and 0 < it["loss"] < 100 for it in rep["iterations"])  # finite
    for bad, why in ((["--precision", "megatron-fp16"], "--precision"),
                     (["--precision", "megatron-bf16", "--dtype", "bfloat16"], "--dtype float32")):
        p = _lynx("train", "--plan", "p.json", "--iters", "1", *bad, cwd=tmp_path)
        assert p.returncode == 2, p.stderr
        assert why in p.stderr and "Traceback" not in p.stderr, p.stderr
