"""The activation-lifetime model (`lynx.lifetime`): the closed form bounds the event simulation for random
valid policies and layouts, and the model's known answers on one layer."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lynx.api import make_problem
from lynx.graph import LayerGraph
from lynx.lifetime import backward_trace
from lynx.memory import layer_memory, linear_peak_bytes, stage_peak_bytes
from lynx.partition.base import Partition
from lynx.policy.base import LayerPolicy, Phase, RecomputePolicy, check_policy
from lynx.policy.rules import full_policy, uniform_policy
from lynx.problem import PlanOptions, PlanProblem
from lynx.simulate import simulate
from lynx.spec import ModelSpec, ParallelSpec, load_hardware

ALL_PHASES = (Phase.FWD_ATTN, Phase.FWD_MLP, Phase.BWD_MLP, Phase.BWD_ATTN, Phase.ON_DEMAND)


def random_layer(draw: st.DrawFn, graph: LayerGraph, fwd_windows: bool) -> LayerPolicy:
    """Each op kept, recomputed in a phase no earlier than its inputs', or (when no backward reads it and
    nothing recomputed reads it) dropped; comm ops only on demand."""
    needed = graph.needed()
    phases: dict[str, Phase] = {}
    keep: set[str] = set()
    choices = [p for p in ALL_PHASES if fwd_windows or p not in (Phase.FWD_ATTN, Phase.FWD_MLP)]
    for op in graph.ops:
        lo = max((phases[d] for d in op.inputs if d in phases), default=Phase.FWD_ATTN)
        ok = [p for p in choices if p >= lo and (not op.is_comm or p == Phase.ON_DEMAND)]
        pick = draw(st.sampled_from(["keep", *([p for p in ok] or ["keep"])]))
        if pick == "keep":
            keep.add(op.name)
        else:
            phases[op.name] = pick
    # ops nothing reads for backward may be dropped instead, when no recomputed op needs them
    readers = {d for n in phases for d in graph.op(n).inputs}
    for n in list(phases):
        if n not in needed and n not in readers and draw(st.booleans()):
            del phases[n]
    return LayerPolicy(keep=frozenset(keep), recompute=tuple((n, phases[n]) for n in graph.names if n in phases))


@st.composite
def cases(draw: st.DrawFn) -> tuple[PlanProblem, Partition, tuple[RecomputePolicy, ...]]:
    pp = draw(st.integers(1, 3))
    layers = draw(st.integers(pp, pp * 4))
    heads = draw(st.sampled_from([8, 16]))
    model = ModelSpec("m", layers, heads * 64, heads, vocab_size=8192,
                      attention=draw(st.sampled_from(["standard", "flash"])))
    tp, mb, m = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2])), draw(st.integers(1, 8))
    par = ParallelSpec(tp=tp, pp=pp, micro_batch_size=mb, global_batch_size=mb * m, seq_length=512,
                       sequence_parallel=tp > 1 and draw(st.booleans()))
    prob = make_problem(model, load_hardware("a100-40g-nvlink"), par, PlanOptions(include_dp_allreduce=False))
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1))) if pp > 1 else []
    bounds = [0, *cuts, layers]
    part = Partition(tuple(bounds[i + 1] - bounds[i] for i in range(pp)))
    pols = []
    for ctx in prob.stage_contexts(part):
        if draw(st.integers(0, 3)) == 0:  # a uniform layout: chunks restore all their layers
            pols.append(uniform_policy(ctx, prob.graph, draw(st.integers(1, 3))))
            continue
        lps = tuple(random_layer(draw, prob.graph, ctx.has_fwd_windows) for _ in range(ctx.num_layers))
        pol = RecomputePolicy(method="random", layers=lps)
        check_policy(prob.graph, pol, ctx)
        pols.append(pol)
    return prob, part, tuple(pols)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_closed_form_bounds_the_event_simulation(case: tuple[PlanProblem, Partition, tuple[RecomputePolicy, ...]]
                                                 ) -> None:
    prob, part, pols = case
    r = simulate(prob, part, pols)
    for s, ctx in zip(r.stages, prob.stage_contexts(part), strict=True):
        assert s.peak_memory_bytes <= stage_peak_bytes(prob.graph, pols[s.stage].layers, ctx) * (1 + 1e-9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_solvers_linear_form_bounds_the_rule(case: tuple[PlanProblem, Partition, tuple[RecomputePolicy, ...]]
                                            ) -> None:
    """HEU's rows and OPT's M5 (`linear_peak_bytes`) never under-state the lifetime rule for policies whose
    layers all checkpoint their input (the solvers' policy space)."""
    prob, part, pols = case
    for ctx, pol in zip(prob.stage_contexts(part), pols, strict=True):
        if all(lp.input_checkpoint for lp in pol.layers):
            assert stage_peak_bytes(prob.graph, pol.layers, ctx) <= linear_peak_bytes(prob.graph, pol.layers, ctx) \
                * (1 + 1e-9)


def _graph() -> LayerGraph:
    model = ModelSpec("m", 4, 1024, 16, vocab_size=8192)
    par = ParallelSpec(tp=1, pp=1, micro_batch_size=1, global_batch_size=1, seq_length=512)
    return make_problem(model, load_hardware("a100-40g-nvlink"), par, PlanOptions()).graph


def test_full_frees_outputs_no_backward_reads() -> None:
    """Full recomputation holds at most every op's output and mask (the old bound), and less: the scores,
    the row-parallel outputs and the all-reduce outputs are freed once their readers are restored."""
    g = _graph()
    prob_ctx = make_problem(ModelSpec("m", 4, 1024, 16, vocab_size=8192), load_hardware("a100-40g-nvlink"),
                            ParallelSpec(tp=1, pp=1, micro_batch_size=1, global_batch_size=1, seq_length=512),
                            PlanOptions())
    ctx = prob_ctx.stage_contexts(Partition((4,)))[0]
    lps = full_policy(ctx, g).layers
    tr = backward_trace(g, lps, fwd_windows=False)
    old = layer_memory(g, lps[0]).on_demand
    needed = sum(g.keep_bytes(n) for n in g.needed())
    assert needed <= tr.peak < old


def test_uniform_chunk_restores_all_its_layers() -> None:
    g = _graph()
    prob = make_problem(ModelSpec("m", 4, 1024, 16, vocab_size=8192), load_hardware("a100-40g-nvlink"),
                        ParallelSpec(tp=1, pp=1, micro_batch_size=1, global_batch_size=1, seq_length=512),
                        PlanOptions())
    ctx = prob.stage_contexts(Partition((4,)))[0]
    one = backward_trace(g, uniform_policy(ctx, g, 1).layers, False).restored_peak
    two = backward_trace(g, uniform_policy(ctx, g, 2).layers, False).restored_peak
    assert two > 1.9 * one - g.input_bytes
