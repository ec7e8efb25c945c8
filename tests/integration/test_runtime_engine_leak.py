"""Restorations leave nothing behind: after an iteration the engine holds no tensor, so the number of live
tensors does not grow from one iteration to the next (docs/runtime-overhead.md). Before the fix, a replayed op
that saves its own output (the causal softmax) kept it alive through its own grad_fn, a reference cycle the
collector cannot see: every iteration leaked the restored outputs and their saved tensors. The forward's op
registry also kept the last layer's outputs until the next step (found with the CUDA allocator,
benchmarks/gpu_memory.py)."""

from __future__ import annotations

import gc
import warnings

import pytest

torch = pytest.importorskip("torch")

from lynx.runtime.engine import RecomputeEngine  # noqa: E402
from lynx.runtime.layers.gpt import GPTLayer, LayerConfig  # noqa: E402
from lynx.runtime.layers.gpt_model import GPTModel  # noqa: E402
from tests.harness.check import method_policy, problem_for, train_step  # noqa: E402
from tests.harness.pipeline_check import overlapped_policy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = LayerConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16, micro_batch_size=2)


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op proxy warns
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@pytest.mark.parametrize("method", ["full", "selective", "overlapped"])
def test_no_tensor_outlives_its_iteration(method: str) -> None:
    prob = problem_for(CFG, 3, 64, 3)
    pol = overlapped_policy(3) if method == "overlapped" else method_policy(method, prob)
    assert any(n == "softmax" for lp in pol.layers for n in lp.recomputed())  # the op that leaked
    model = GPTModel(CFG, 3, 64)
    engine = RecomputeEngine(list(model.layers), pol)
    for _ in range(2):  # warm-up: gradients and lazily built state exist from here on
        train_step(model, 3, engine, in_flight=2)
    before = _live_tensors()
    for _ in range(3):
        train_step(model, 3, engine, in_flight=2)
    assert engine.stats.restored_on_demand + engine.stats.restored_in_window > 0
    assert _live_tensors() == before


def _live_tensor_bytes() -> int:
    gc.collect()
    return sum({o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
                for o in gc.get_objects() if type(o) is torch.Tensor}.values())


@pytest.mark.parametrize("method", ["none", "full"])
def test_nothing_held_between_steps(method: str) -> None:
    """Bytes, not counts, and from the first step on: with nothing recomputed too (the registry)."""
    cfg = LayerConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
                      micro_batch_size=2, num_layers=3)
    stack = torch.nn.ModuleList(GPTLayer(cfg, None, layer_index=i) for i in range(3))
    eng = RecomputeEngine(list(stack), method_policy(method, problem_for(cfg, 3, 100, 1, recompute_num_layers=2)))
    before = _live_tensor_bytes()
    for _ in range(2):
        x = torch.randn(32, 2, 64, requires_grad=True)
        y = eng.forward(x, 0)
        y.backward(torch.ones_like(y))
        eng.end_step()
        del x, y
        for p in stack.parameters():
            p.grad = None
        assert _live_tensor_bytes() == before, method
