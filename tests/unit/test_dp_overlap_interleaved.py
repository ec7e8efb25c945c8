"""Megatron's data-parallel overlaps on interleaved stages (chunk by chunk) and the passes over the gradient
buffer every iteration makes (`lynx.cost.dp_overlap`, `lynx.cost.static_memory.grad_buffer_passes`)."""

from __future__ import annotations

import dataclasses

import pytest

import lynx.simulate.metrics as metrics
from lynx.api import make_problem, plan
from lynx.cost.dp_overlap import DpSync, dp_sync, dp_sync_chunks, interleaved_exposed
from lynx.cost.static_memory import RECIPES, grad_buffer_passes, grad_buffer_time
from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec, load_hardware

H100 = "h100-80g-nvlink"


def _sync(g: float, p: float = 0.0) -> DpSync:
    return DpSync(grad_s=g, grad_bucket_s=g / 10, param_s=p, param_bucket_s=p / 10)


def test_one_chunk_is_the_plain_rule() -> None:
    s = _sync(1.0, 0.5)
    for og, op in ((True, True), (True, False), (False, True), (False, False)):
        assert interleaved_exposed([s], og, op, [0.3], [0.2], pp=4, rank=2) == s.exposed(og, op, 0.3, 0.2)


def test_chunk_reductions_hide_behind_the_backwards_of_the_chunks_below() -> None:
    chunks = [_sync(0.2), _sync(0.2), _sync(0.2), _sync(0.2)]
    # plenty of backward below every chunk: only chunk 0's reduction (launched after the last backward) shows
    assert interleaved_exposed(chunks, True, False, [1.0] * 4, [1.0] * 4, pp=4, rank=0) == pytest.approx(0.2)
    # no backward to hide behind: the whole chain after the end
    assert interleaved_exposed(chunks, True, False, [0.0] * 4, [0.0] * 4, pp=4, rank=0) == pytest.approx(0.8)
    # without the switch everything is exposed, as before
    assert interleaved_exposed(chunks, False, False, [1.0] * 4, [1.0] * 4, pp=4, rank=0) == pytest.approx(0.8)
    # the chain is serial: chunk 3 launched 3 x pp x 0.01 = 0.12 s early runs until 0.08, then chunks 2, 1 wait
    # for it: 0.08 + 0.2 + 0.2 + 0.2 (chunk 0 after the end too)
    got = interleaved_exposed(chunks, True, False, [0.01] * 4, [0.0] * 4, pp=4, rank=0)
    assert got == pytest.approx(0.68)


def test_megatrons_delayed_launch_on_later_ranks_exposes_more() -> None:
    chunks = [_sync(0.3)] * 3
    bwd = [0.02] * 3
    early = interleaved_exposed(chunks, True, False, bwd, bwd, pp=8, rank=0)
    late = interleaved_exposed(chunks, True, False, bwd, bwd, pp=8, rank=7)
    assert early < late


def test_parameter_gathers_hide_behind_each_chunks_own_first_forward() -> None:
    chunks = [_sync(0.0, 0.2)] * 3
    # Megatron dispatches the next bucket's gather when the pre-hook waits for the previous one: each chunk's
    # gather runs during its own first forward, and what it leaves adds up over the chunks
    assert interleaved_exposed(chunks, False, True, [0.0] * 3, [0.15] * 3, pp=4, rank=0) == pytest.approx(0.15)
    # a forward longer than the gather still waits for its first bucket
    assert interleaved_exposed(chunks, False, True, [0.0] * 3, [1.0] * 3, pp=4, rank=0) == pytest.approx(0.06)
    # no forward to hide behind: the whole chain
    assert interleaved_exposed(chunks, False, True, [0.0] * 3, [0.0] * 3, pp=4, rank=0) == pytest.approx(0.6)


def test_chunk_parameters_add_up_to_the_stage_and_the_embedding_sits_on_chunk_zero() -> None:
    m, hw = load_model("gpt-7b"), load_hardware(H100)
    par = ParallelSpec(tp=4, pp=2, dp=16, sequence_parallel=True, micro_batch_size=1, global_batch_size=64,
                       seq_length=2048)
    link = hw.link_for_group(par.dp, par.tp)
    recipe = RECIPES["megatron-bf16"]
    for stage in (0, 1):
        whole = dp_sync(m, par, stage, 16, recipe, link, True)
        parts = dp_sync_chunks(m, par, stage, (8, 8), recipe, link, True)
        # ring collectives: time is linear in bytes past the fixed latency term
        lat = (par.dp - 1) * link.latency_s
        assert sum(p.grad_s - lat for p in parts) == pytest.approx(whole.grad_s - lat)
        assert sum(p.param_s - lat for p in parts) == pytest.approx(whole.param_s - lat)
    first = dp_sync_chunks(m, par, 0, (8, 8), recipe, link, True)
    assert first[0].grad_s > first[1].grad_s  # the word embedding
    last = dp_sync_chunks(m, par, 1, (8, 8), recipe, link, True)
    assert last[1].grad_s >= last[0].grad_s  # the head (tied: the final norm only)


def test_an_interleaved_plan_hides_more_of_its_reduction_than_one_chunk_would(
        monkeypatch: pytest.MonkeyPatch) -> None:
    m, hw = load_model("gpt-7b"), load_hardware(H100)
    par = ParallelSpec(tp=8, pp=4, dp=16, sequence_parallel=True, micro_batch_size=1, global_batch_size=128,
                       seq_length=2048)
    opts = PlanOptions(precision="megatron-bf16", distributed_optimizer=True, nodes=64, overlap_grad_reduce=True,
                       tp_comm_overlap=True, vpp=2)

    def tail() -> float:
        sim = plan(make_problem(m, hw, par, opts), "none", record=False).sim
        return sim.iteration_time_s - sim.pipeline_time_s

    chunked = tail()

    def as_one_chunk(chunks: list[DpSync], og: bool, op: bool, bwd: list[float], fwd: list[float], pp: int,
                     rank: int) -> float:  # the rule before: the stage as one chunk
        one = DpSync(sum(c.grad_s for c in chunks), max(c.grad_bucket_s for c in chunks),
                     sum(c.param_s for c in chunks), max(c.param_bucket_s for c in chunks))
        return one.exposed(og, op, sum(bwd), sum(fwd))

    monkeypatch.setattr(metrics, "interleaved_exposed", as_one_chunk)
    assert chunked < tail()


def test_grad_buffer_passes_are_megatrons_zero_norm_and_scale() -> None:
    one = ParallelSpec(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, seq_length=128)
    assert grad_buffer_passes(one) == 2  # zero_() and the NaN check's norm; no 1/DP scaling at DP 1
    assert grad_buffer_passes(dataclasses.replace(one, dp=4, global_batch_size=4)) == 4


def test_the_iteration_pays_the_grad_buffer_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    m, hw = load_model("gpt-7b"), load_hardware(H100)
    par = ParallelSpec(tp=2, pp=1, dp=8, sequence_parallel=True, micro_batch_size=2, global_batch_size=32,
                       seq_length=2048)
    opts = PlanOptions(precision="megatron-bf16", distributed_optimizer=True, nodes=2)
    with_passes = plan(make_problem(m, hw, par, opts), "none", record=False).sim.iteration_time_s
    monkeypatch.setattr(metrics, "grad_buffer_time", lambda *a, **k: 0.0)
    without = plan(make_problem(m, hw, par, opts), "none", record=False).sim.iteration_time_s
    expect = grad_buffer_time(m, par, 0, m.num_layers, RECIPES["megatron-bf16"], hw.device)
    assert with_passes - without == pytest.approx(expect)
    assert expect > 0


def test_the_chunk_order_interleaved_exposed_assumes_is_the_simulated_schedules() -> None:
    """`interleaved_exposed` takes chunk c's last backward to end pp x (one micro-batch's backward of every chunk
    below it) before the rank's last backward: checked on the simulator's own timeline of Megatron's
    interleaved order (cool-down stalls only put it earlier, which hides more)."""
    m, hw = load_model("gpt-7b"), load_hardware(H100)
    par = ParallelSpec(tp=8, pp=4, dp=16, sequence_parallel=True, micro_batch_size=1, global_batch_size=128,
                       seq_length=2048)
    opts = PlanOptions(precision="megatron-bf16", distributed_optimizer=True, nodes=64, overlap_grad_reduce=True,
                       overlap_param_gather=True, vpp=4)
    sim = plan(make_problem(m, hw, par, opts), "none", record=True).sim
    bwd = [seg for seg in sim.segments if seg.kind.value == "B"]
    for rank in range(par.pp):
        mine = [seg for seg in bwd if seg.stage == rank]
        end = max(seg.end for seg in mine)
        per_chunk = {c: max(seg.end for seg in mine if seg.chunk == c) for c in range(4)}
        one = {c: min(seg.end - seg.start for seg in mine if seg.chunk == c) for c in range(4)}
        for c in range(1, 4):
            assert per_chunk[c] <= end - par.pp * sum(one[k] for k in range(c)) + 1e-9, (rank, c)
        assert per_chunk[0] == pytest.approx(end)
