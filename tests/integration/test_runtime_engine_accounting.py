"""The engine's running total of held bytes equals its definition (a scan of every live record) after every
forward pass and after each iteration, for every rule policy, a policy using all windows, and the 1F1B order
of a first stage (forward windows of later passes).

Inside a layer's backward the two may differ: a storage autograd already freed is still a key of the layer's
record until the record is released, and a restoration allocated at the same address is then counted with
one size or the other (both over-count the freed storage, as before the running total existed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from lynx.runtime.engine import RecomputeEngine  # noqa: E402
from lynx.runtime.layers.gpt import LayerConfig  # noqa: E402
from lynx.runtime.layers.gpt_model import GPTModel  # noqa: E402
from tests.harness.check import method_policy, problem_for, train_step  # noqa: E402
from tests.harness.pipeline_check import overlapped_policy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = LayerConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16, micro_batch_size=2)


class CheckedEngine(RecomputeEngine):
    checks = 0

    def forward(self, x, microbatch=0, hosts=None):  # type: ignore[no-untyped-def]
        out = super().forward(x, microbatch, hosts)
        assert self.held_bytes() == self.held_bytes_scan() == self.stats.fwd_end_bytes[-1]
        CheckedEngine.checks += 1
        return out


@pytest.mark.parametrize("method", ["none", "full", "selective", "uniform", "block", "overlapped"])
def test_running_total_equals_the_scan(method: str) -> None:
    prob = problem_for(CFG, 3, 64, 3, recompute_num_layers=2)
    pol = overlapped_policy(3) if method == "overlapped" else method_policy(method, prob)
    model = GPTModel(CFG, 3, 64)
    eng = CheckedEngine(model.layers, pol)
    CheckedEngine.checks = 0
    for _ in range(2):
        train_step(model, 3, eng, in_flight=2)
        assert eng.held_bytes() == eng.held_bytes_scan() == 0  # end_step released everything
    assert CheckedEngine.checks == 2 * 3
    assert eng.stats.peak_bytes > 0
