"""The work outside the layers priced from bytes: the optimizer step (memory-bound over the parameters a rank
updates) and the embedding / LM head edges."""

from __future__ import annotations

import pytest

from lynx.cost.layer import edge_times
from lynx.cost.static_memory import RECIPES, Precision, optimizer_step_bytes, optimizer_step_time, stage_params
from lynx.models import load_model
from lynx.spec import ParallelSpec, load_hardware


def test_adam_bytes_per_parameter() -> None:
    # paper: grad 2 (read twice: clip norm + step) + master 4 (r/w) + m, v 4 each (r/w) + 16-bit copy 2
    assert optimizer_step_bytes(RECIPES[Precision.PAPER]) == 2 * 2 + 2 * 4 + 2 * 8 + 2
    # bf16 with fp32 main gradients reads 4-byte gradients
    assert optimizer_step_bytes(RECIPES[Precision.MEGATRON_BF16]) == 2 * 4 + 2 * 4 + 2 * 8 + 2
    # fp32: the parameters are the main weights (read + write), no copy
    assert optimizer_step_bytes(RECIPES[Precision.FP32]) == 2 * 4 + 2 * 4 + 2 * 8


def test_step_time_is_memory_bound_and_sharded() -> None:
    model, hw = load_model("gpt-7b"), load_hardware("a100-40g-nvlink")
    par = ParallelSpec(tp=4, pp=4, micro_batch_size=1, global_batch_size=64, seq_length=1024, dp=4)
    r = RECIPES[Precision.MEGATRON_BF16]
    full = optimizer_step_time(model, par, 1, 8, r, hw.device)
    n = stage_params(model, par, 1, 8).total
    bw = hw.device.memory_bandwidth_Bps * hw.device.memory_efficiency
    assert full == pytest.approx(n * 34 / bw)
    assert optimizer_step_time(model, par, 1, 8, r, hw.device, distributed_optimizer=True) == pytest.approx(full / 4)


def test_edges_scale_with_vocab() -> None:
    hw = load_hardware("a100-40g-nvlink")
    par = ParallelSpec(tp=1, pp=1, micro_batch_size=1, global_batch_size=1, seq_length=1024)
    small = edge_times(load_model("gpt-7b"), hw, par)
    assert small.head_fwd > small.embedding_fwd > 0 and small.head_bwd > small.head_fwd
