"""Nothing the engine touched outlives a training step.

A recomputed op that saves its own output (softmax, the dropout output...) tied the output to its grad_fn
through the saved value: a cycle through C++ that Python's collector never frees, so every step leaked the
restored tensors (1 MiB a step on this tiny stack; gigabytes on the GPU, where `benchmarks/gpu_memory.py`
found it). The forward's op registry also kept the last layer's outputs until the next step.
"""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from lynx.runtime.check import method_policy, problem_for  # noqa: E402
from lynx.runtime.engine import RecomputeEngine  # noqa: E402
from lynx.runtime.layer import GPTLayer, LayerConfig  # noqa: E402


def _live_tensor_bytes() -> int:
    gc.collect()
    return sum({o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
                for o in gc.get_objects() if type(o) is torch.Tensor}.values())


@pytest.mark.parametrize("method", ["none", "selective", "full", "block"])
def test_no_tensor_outlives_a_step(method: str) -> None:
    torch.manual_seed(0)
    cfg = LayerConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
                      micro_batch_size=2, num_layers=3)
    stack = torch.nn.ModuleList(GPTLayer(cfg, None, layer_index=i) for i in range(3))
    eng = RecomputeEngine(list(stack), method_policy(method, problem_for(cfg, 3, 100, 1, recompute_num_layers=2)))
    before = _live_tensor_bytes()
    for _ in range(3):
        x = torch.randn(32, 2, 64, requires_grad=True)
        y = eng.forward(x, 0)
        y.backward(torch.ones_like(y))
        eng.end_step()
        del x, y
        for p in stack.parameters():
            p.grad = None
        assert _live_tensor_bytes() == before, method
