"""`simulate_time` (no memory replay) gives `simulate`'s iteration time to the last bit, on the plans the search's
plain bounds price and on plans that recompute inside windows, hide cool-down work in stalls, offload and shard."""

from __future__ import annotations

import pytest

from lynx.api import make_problem, plan
from lynx.cost.fsdp import FSDP2
from lynx.methods.common import base_partition, plain_time
from lynx.models import load_model
from lynx.problem import PlanOptions, PlanProblem
from lynx.simulate import simulate, simulate_time
from lynx.simulate.engine import chunk_layer_count
from lynx.simulate.memory_replay import StageMemory
from lynx.spec import ParallelSpec, load_hardware


def _problem(model: str, tp: int, pp: int, dp: int, mbs: int, gbs: int, seq: int, **opts: object) -> PlanProblem:
    par = ParallelSpec(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, global_batch_size=gbs, seq_length=seq,
                       cp=int(opts.pop("cp", 1)))  # type: ignore[call-overload]
    return make_problem(load_model(model), load_hardware("h100-80g-nvlink"), par, PlanOptions(**opts))  # type: ignore[arg-type]


CASES = [
    ("1F1B, lynx", _problem("llama3-70b", 8, 4, 2, 1, 32, 4096, budget_bytes=45 * 2**30), "lynx"),
    ("interleaved, lynx", _problem("llama3-70b", 4, 4, 4, 1, 128, 8192, vpp=5, overlap_grad_reduce=True,
                                   distributed_optimizer=True, overlap_param_gather=True,
                                   budget_bytes=50 * 2**30), "lynx"),
    ("interleaved, lynx-offload", _problem("llama3-70b", 4, 4, 4, 1, 64, 8192, vpp=4, distributed_optimizer=True,
                                           budget_bytes=50 * 2**30), "lynx-offload"),
    ("1F1B, full", _problem("gpt-175b", 8, 8, 1, 1, 64, 2048), "full"),
    ("interleaved, selective", _problem("llama3-8b", 2, 2, 2, 1, 32, 8192, vpp=4, distributed_optimizer=True),
     "selective"),
    ("CP 2, FSDP, lynx", _problem("llama3-8b", 1, 2, 4, 1, 32, 8192, cp=2, dp_sharding=FSDP2,
                                  budget_bytes=45 * 2**30), "lynx"),
]


@pytest.mark.parametrize(("name", "problem", "method"), CASES, ids=[c[0] for c in CASES])
def test_the_time_without_memory_is_the_simulations_to_the_bit(name: str, problem: PlanProblem, method: str) -> None:
    p = plan(problem, method)
    full = simulate(problem, p.result.partition, p.result.policies, record=False)
    assert not full.oom
    if method != "full" and method != "selective":  # the cases that recompute inside windows or offload do
        assert sum(s.recompute_total_s for s in full.stages) > 0 or any(s.offloaded_bytes for s in full.stages)
    assert simulate_time(problem, p.result.partition, p.result.policies) == full.iteration_time_s
    recorded = simulate(problem, p.result.partition, p.result.policies, record=True)
    assert recorded.iteration_time_s == full.iteration_time_s


@pytest.mark.parametrize(("name", "problem", "method"), CASES, ids=[c[0] for c in CASES])
def test_the_plain_bound_is_the_simulated_time_of_keeping_everything(name: str, problem: PlanProblem,
                                                                     method: str) -> None:
    part = base_partition(problem)
    none = plan(problem, "none").result
    if (none.partition.layers_per_stage, none.partition.chunks) == (part.layers_per_stage, part.chunks):
        assert plain_time(problem, part) == simulate(problem, part, none.policies, record=False).iteration_time_s


def test_a_plan_for_another_pipeline_is_refused() -> None:
    problem = CASES[0][1]
    p = plan(problem, "full")
    with pytest.raises(ValueError, match="policies for PP"):
        simulate_time(problem, p.result.partition, p.result.policies[:-1])


@pytest.mark.parametrize(("name", "problem", "method"), CASES, ids=[c[0] for c in CASES])
def test_a_chunks_layer_count_is_the_memory_replays(name: str, problem: PlanProblem, method: str) -> None:
    """What a hosted chunk's carried work is priced on (`chunk_layer_count`, read where no memory is kept) is the
    layer count of that chunk in the stage's memory replay, which the simulator read before."""
    p = plan(problem, method, record=False)
    for ctx, pol in zip(problem.stage_contexts(p.result.partition), p.result.policies, strict=True):
        replay = StageMemory(problem.graphs_for(ctx), pol, ctx, record=False)
        assert [chunk_layer_count(ctx, c) for c in range(len(replay.chunks))] == [len(c) for c in replay.chunks]
        assert len(replay.chunks) == max(1, len(ctx.chunk_layers))
