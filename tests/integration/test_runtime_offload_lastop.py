"""The layer's last op under offloading (decision 0087): the engine offloads what it saves beside its
output (the residual dropout mask, what the planner's `keep_bytes` counts for it) and never its output (the next
layer's input, always stored); gradients stay bitwise those of keeping it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from lynx.decisions import RecomputePolicy  # noqa: E402
from tests.harness.check import grads_of  # noqa: E402
from tests.integration.test_runtime_offload import CFG, LAYERS, MBS, _keep_all, _run, with_offload  # noqa: E402


def test_last_op_offloads_its_mask_not_its_output() -> None:
    ref, _ = _run(None, 2)
    last = ref.layers[0].op_names[-1]
    pol = RecomputePolicy("o", (with_offload(_keep_all(ref), frozenset({last})),) * LAYERS)
    model, eng = _run(pol, 2)
    want, got = grads_of(ref), grads_of(model)
    assert not [n for n in want if not torch.equal(want[n], got[n])]
    # one byte per element of the layer's [s, b, h] output: the dropout mask, per layer and micro-batch
    mask = CFG.seq_length * CFG.micro_batch_size * CFG.hidden_size
    assert eng.stats.offloaded_bytes == LAYERS * MBS * mask
    assert eng.stats.reloaded_bytes == eng.stats.offloaded_bytes and eng.stats.host_bytes == 0
