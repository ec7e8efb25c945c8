"""CUDA path of the runtime (skipped without a GPU; CI has none).

- Gradient equality on CUDA for every rule policy and the hand-made overlapped one (float32; the replay runs
  the same kernels on the same inputs, so equality is expected bit for bit; TF32 is switched off).
- A window on one GPU: two processes share the GPU and talk over gloo (CUDA tensors); the window's matmuls
  run on the compute stream while `run_collective` runs the all-reduce on its side stream, and the result is
  right. How much time the overlap hides is a measurement: benchmarks/bench_gpu_overlap.py.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_gradients_equal_for_every_policy() -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from test_runtime_engine import CFG, LAYERS, MBS, VOCAB, policies

    from lynx.runtime.engine import RecomputeEngine
    from lynx.runtime.layers.gpt_model import GPTModel
    from tests.harness.check import grads_of, train_step

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", 0)
    ref = GPTModel(CFG, LAYERS, VOCAB, device=dev)
    loss0 = train_step(ref, MBS, None, 2)
    g0 = grads_of(ref)
    for name, pol in policies(CFG).items():
        model = GPTModel(CFG, LAYERS, VOCAB, device=dev)
        eng = RecomputeEngine(model.layers, pol)
        loss = train_step(model, MBS, eng, 2)
        g = grads_of(model)
        assert loss == pytest.approx(loss0, rel=1e-6), name
        for n in g0:
            torch.testing.assert_close(g[n], g0[n], rtol=1e-5, atol=1e-6, msg=f"{name}: {n}")


def test_window_overlaps_collective_on_side_stream(tmp_path) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "r.json"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_gpu_overlap import worker  # the benchmark's worker: the same window, timed there

    mp.spawn(worker, args=(port, str(out)), nprocs=2, join=True)
    r = json.loads(out.read_text())
    assert r["correct"]  # how much of the window the collective hides is measured by bench_gpu_overlap.py
