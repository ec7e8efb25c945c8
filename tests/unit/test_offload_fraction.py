"""`lynx.policy.offload_fraction`: a stated fraction of a stage's retained activation bytes marked offloaded, as
evenly over the layers as op sizes allow; layer inputs and fully recomputed layers offer nothing; the result is a
valid policy the simulator prices (docs/offload.md, docs/mist.md)."""

from __future__ import annotations

import pytest

from lynx.api import make_problem
from lynx.decisions import StageContext, validate_layer_policy
from lynx.errors import SpecError
from lynx.graph import LayerGraph
from lynx.models import load_model
from lynx.partition.base import Partition
from lynx.policy.offload_fraction import offload_fraction, offloadable, retained_stage_bytes
from lynx.policy.rules import block_policy, none_policy
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec, load_hardware


def _stage() -> tuple[LayerGraph, StageContext]:
    """Mist's gpt 1.3b on two L4s, stage 0 of 12 layers (a real graph: ops of many sizes)."""
    par = ParallelSpec(tp=1, pp=2, dp=1, micro_batch_size=1, global_batch_size=8, seq_length=2048)
    prob = make_problem(load_model("mist-gpt-1.3b"), load_hardware("l4-24g-pcie"), par,
                        PlanOptions(precision="paper", check_for_nan_in_grad=False))
    return prob.graph, prob.stage_contexts(Partition((12, 12), "explicit"))[0]


@pytest.mark.parametrize("fraction", [0.125, 0.375, 0.5, 0.75])
def test_reaches_the_stated_fraction_within_half_an_op(fraction: float) -> None:
    g, ctx = _stage()
    base = none_policy(ctx, g)
    off = offload_fraction(g, base, fraction)
    total = retained_stage_bytes(g, base.layers)
    biggest = max(g.keep_bytes(n) for n in offloadable(g, base.layers[0]))
    assert off.retained_bytes == total
    assert abs(off.offloaded_bytes - fraction * total) <= biggest / 2
    assert off.reached == pytest.approx(off.offloaded_bytes / total)
    for before, after in zip(base.layers, off.policy.layers, strict=True):
        assert after.offload <= after.keep and after.keep == before.keep and after.recompute == before.recompute
        assert not validate_layer_policy(g, after, ctx.has_fwd_windows)
    per_layer = [sum(g.keep_bytes(n) for n in lp.offload) for lp in off.policy.layers]
    assert max(per_layer) - min(per_layer) <= biggest  # spread over the layers, not piled on a few


def test_recomputed_layers_pass_their_share_to_the_others() -> None:
    g, ctx = _stage()
    k = ctx.num_layers // 2
    base = block_policy(ctx, g, k)
    off = offload_fraction(g, base, 0.5)
    assert all(not lp.offload for lp in off.policy.layers[:k])  # a recomputed layer keeps only its input
    assert off.reached == pytest.approx(0.5, abs=0.05)
    assert off.retained_bytes == pytest.approx(k * g.input_bytes + (ctx.num_layers - k) * g.retained_bytes(
        base.layers[-1].keep))


def test_zero_and_everything() -> None:
    g, ctx = _stage()
    base = none_policy(ctx, g)
    assert offload_fraction(g, base, 0.0).policy == base
    full = offload_fraction(g, base, 1.0)  # every kept op, never the layer inputs
    inputs = len(base.layers) * g.input_bytes
    assert full.offloaded_bytes == pytest.approx(full.retained_bytes - inputs)
    assert full.reached < 1.0
    with pytest.raises(SpecError, match=r"fraction 1.5 must lie in \[0, 1\]"):
        offload_fraction(g, base, 1.5)
