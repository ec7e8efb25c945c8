"""lynx's engine under Megatron-Core's DDP with its overlaps (docs/decisions/0162), on CPU over gloo at DP 2
(and DP 2 x TP 2): ``overlap_grad_reduce``, each gradient bucket's all-reduce (reduce-scatter with the
distributed optimizer's layout) launched from DDP's own parameter hooks while the backward still runs, and
``overlap_param_gather``, each parameter bucket's all-gather waited for in the forward pre-hooks of the modules
that use it (which the engine runs for the linears it computes itself; the harness leaves the other ranks'
shards stale before each step, as the distributed optimizer's step does, so a weight read before its gather
changes the result). Two steps per run, the same batch each (Megatron launches during backward from its second
step on); the second step's losses and every gradient bitwise equal to Megatron's own run without recomputation
and with its full recomputation, every restoration where the plan put it (the plan places none in a DDP
collective: nothing waits for one before the backward ends), and some of them run while a bucket's collective
was in flight (small buckets): the overlap the engine's on-demand work gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harness.megatron_plans import Shape, expected_places

pytest.importorskip("megatron.core")

BUCKET = 5_000
"""Parameters per DDP bucket: a tiny layer holds ~33k-50k, so its gradients fill several buckets and the top
layer's are launched before the bottom layer's backward (Megatron's default, 40M, is one bucket here)."""

CASES = {
    "dp2-gpt": Shape(dp=2, dropout=0.1, overlap_grad_reduce=True, bucket_size=BUCKET, steps=2),
    "dp2-llama-distributed-optimizer": Shape(dp=2, llama=True, groups=2, overlap_grad_reduce=True,
                                             distributed_optimizer=True, overlap_param_gather=True,
                                             bucket_size=BUCKET, steps=2),
    "dp2-tp2-sp-llama": Shape(dp=2, tp=2, sp=True, llama=True, groups=2, overlap_grad_reduce=True,
                              bucket_size=BUCKET, steps=2),
}


def _check(ranks: list[dict[str, Any]], s: Shape) -> None:
    for r in ranks:
        for mode in ("full", "lynx"):
            assert r[mode]["grads_equal"], (r["rank"], mode, r[mode]["max_diff"])
            assert r[mode]["losses_equal"], (r["rank"], mode)
        plan = {k: v * s.steps for k, v in expected_places(s, 0).items()}
        assert r["stats"] == [plan], (r["rank"], r["stats"], plan)
        assert r["held_after_step"] == [0]
        assert r["restored_in_ddp_collective"] > 0, r["rank"]


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_grad_reduce_bitwise_and_where_planned(case: str, tmp_path: Path) -> None:
    from tests.harness.megatron_check import run

    s = CASES[case]
    _check(run(s, tmp_path), s)
