"""Restorations leave nothing behind: after an iteration the engine holds no tensor, so the number of live
tensors does not grow from one iteration to the next (docs/runtime-overhead.md). Before the fix, a replayed op
that saves its own output (the causal softmax) kept it alive through its own grad_fn, a reference cycle the
collector cannot see: every iteration leaked the restored outputs and their saved tensors."""

from __future__ import annotations

import gc
import warnings

import pytest

torch = pytest.importorskip("torch")

from lynx.runtime.check import method_policy, problem_for, train_step  # noqa: E402
from lynx.runtime.engine import RecomputeEngine  # noqa: E402
from lynx.runtime.layer import LayerConfig  # noqa: E402
from lynx.runtime.model import GPTModel  # noqa: E402
from lynx.runtime.pipeline_check import overlapped_policy  # noqa: E402

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
