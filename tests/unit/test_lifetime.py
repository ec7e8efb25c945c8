"""The activation-lifetime model (`lynx.cost.lifetime`): the closed form bounds the event simulation for random
valid policies and layouts, and the model's known answers on one layer."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lynx.api import make_problem
from lynx.cost.lifetime import _independent, _independent_trace, _replayed_trace, _window_op, backward_trace
from lynx.cost.memory import layer_memory, linear_peak_bytes, predicted_activation_bytes, stage_peak_bytes
from lynx.decisions import LayerPolicy, Phase, RecomputePolicy, StageContext, check_policy
from lynx.graph import LayerGraph
from lynx.partition.base import Partition
from lynx.policy.rules import (
    checkpointed_layer,
    full_layer,
    full_policy,
    keep_all,
    selective_layer,
    uniform_policy,
)
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


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_independent_layers_are_traced_from_one_replay_each_with_the_same_floats(data: st.DataObject) -> None:
    """Where no layer's backward touches another's bytes (`lifetime._independent`), the trace built from one
    replay per distinct (graph, policy) equals the whole pass's replay float for float, per layer: Megatron's
    rules (block mixes full and kept layers; the module lists re-run kept ops) and random on-demand policies,
    shared objects or not, with the runtime's extra bytes, in both samplings."""
    g = _graph()
    fwd_windows = data.draw(st.booleans())
    mixed = data.draw(st.booleans())
    rules = [keep_all(g), full_layer(g), selective_layer(g), checkpointed_layer(g, ("ln1", "ln2")),
             checkpointed_layer(g, ("attn_scores", "softmax", "attn_dropout", "attn_context"))]
    late = (Phase.BWD_MLP, Phase.BWD_ATTN) + ((Phase.FWD_ATTN, Phase.FWD_MLP) if fwd_windows else ())
    drawn = [random_layer(data.draw, g, False) for _ in range(2)]
    pool = rules + [LayerPolicy(lp.keep, tuple((n, Phase.ON_DEMAND if p in late else p) for n, p in lp.recompute))
                    for lp in drawn]
    n = data.draw(st.integers(1, 7))
    picks = [data.draw(st.sampled_from(pool)) for _ in range(n)]
    layers = tuple(LayerPolicy(lp.keep, lp.recompute, lp.input_checkpoint, lp.rerun) if mixed else lp
                   for lp in picks)  # copies: equal policies that are distinct objects
    extra = data.draw(st.sampled_from([None, {g.names[0]: 4096.0, g.names[-2]: 512.0}]))
    transient = data.draw(st.booleans())
    assert _independent(layers, fwd_windows)
    fast = _independent_trace(g, layers, extra or {}, transient)
    assert fast == _replayed_trace(g, layers, fwd_windows, extra or {}, transient)


def test_a_layer_restored_in_the_backward_above_is_replayed_with_its_neighbour() -> None:
    """Phase 3/4 restores run in the backward of the layer above, phase 1/2 restores are held from a later
    forward, and a layer that does not checkpoint its input restores the one below: none is traced alone."""
    g = _graph()
    op = next(o.name for o in g.ops if not o.is_comm and o.name != g.output_op)
    for ph in (Phase.BWD_MLP, Phase.BWD_ATTN):
        assert not _independent((keep_all(g), on_demand_at(g, op, ph)), fwd_windows=False)
    assert not _independent((keep_all(g), on_demand_at(g, op, Phase.FWD_ATTN)), fwd_windows=True)
    assert _independent((keep_all(g), on_demand_at(g, op, Phase.FWD_ATTN)), fwd_windows=False)
    full = full_layer(g)
    assert not _independent((full, LayerPolicy(full.keep, full.recompute, input_checkpoint=False)), False)
    assert _independent((LayerPolicy(full.keep, full.recompute, input_checkpoint=False), full), False)


def on_demand_at(g: LayerGraph, op: str, phase: Phase) -> LayerPolicy:
    """Every op kept but `op`, recomputed in `phase`."""
    return LayerPolicy(keep=frozenset(n for n in g.names if n != op), recompute=((op, phase),))


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


def _chain() -> LayerGraph:
    """A hand-sized layer: scores (100 B) from the input (10 B), probs (100 B, softmax-like: its backward
    reads its own output) from the scores, the layer output (10 B) from the probs."""
    from lynx.graph import Op

    return LayerGraph(ops=(
        Op("scores", "compute", "attn", 1.0, 1.0, 100.0, ("input",), saved=("input",)),
        Op("probs", "compute", "attn", 1.0, 1.0, 100.0, ("scores",), saved=("probs",)),
        Op("out", "compute", "attn", 1.0, 1.0, 10.0, ("probs",), saved=("probs",)),
    ), input_bytes=10.0)


def _ctx(fwd_windows: bool) -> StageContext:
    return StageContext(stage=0, num_stages=2, num_layers=1, in_flight=2, num_microbatches=4, budget_bytes=1e9,
                        static_bytes=0.0, fwd_windows=fwd_windows)


def test_a_restoration_holds_its_input_beside_its_output() -> None:
    """Restoring probs on demand: the scores (100) are alive when probs (100) is produced and freed only
    after; the allocator's peak is 200, the engine's ledger (sampled after the frees) 100."""
    g = _chain()
    lp = LayerPolicy(keep=frozenset(), recompute=(("scores", Phase.ON_DEMAND), ("probs", Phase.ON_DEMAND)))
    assert backward_trace(g, (lp,), fwd_windows=False).peak == 200.0
    assert backward_trace(g, (lp,), fwd_windows=False, transient=False).peak == 100.0
    # the closed form: retained = the input (10) per micro-batch, 2 in flight; dropped in forward 200
    ctx = _ctx(False)
    assert stage_peak_bytes(g, (lp,), ctx) == 2 * 10.0 + max(200.0, 200.0)
    # what the runtime's check compares with the engine: the ledger's view, unchanged
    after, peak = predicted_activation_bytes(g, (lp,), [0.0], 2, False)
    assert (after, peak) == (20.0, 120.0)
    assert predicted_activation_bytes(g, (lp,), [0.0], 2, False, transient=True)[1] == 220.0


def test_a_forward_window_restoration_is_counted_in_the_forward() -> None:
    """Both ops restored in the next forward's attention window: they leave probs (100) held, and while
    probs was produced the scores (100) were alive too: a transient of 100 above the holdings, on top of
    the hosting forward's own working set (200 dropped): 2 x 10 + 100 + 200 + 100."""
    g = _chain()
    lp = LayerPolicy(keep=frozenset(), recompute=(("scores", Phase.FWD_ATTN), ("probs", Phase.FWD_ATTN)))
    tr = backward_trace(g, (lp,), fwd_windows=True)
    assert tr.fwd_held == (100.0,) and tr.fwd_transient == 100.0 and tr.peak == 0.0
    assert stage_peak_bytes(g, (lp,), _ctx(True)) == 2 * 10.0 + 100.0 + 200.0 + 100.0


def test_gpt_full_counts_the_allreduce_restoration() -> None:
    """GPT's full recomputation (every op restored on demand, top layer first): the ledger's peak is after
    the MLP all-reduce's restore, once FC2's output is freed; the allocator also sees each restoration's output
    beside its inputs. The highest such moment is the residual's restore (for its dropout mask): the all-reduce
    output beside the rebuilt layer output and its mask, the ledger's peak plus exactly those two (FC2's
    output beside the all-reduce's, 1 MiB, is lower)."""
    g = _graph()
    prob = make_problem(ModelSpec("m", 4, 1024, 16, vocab_size=8192), load_hardware("a100-40g-nvlink"),
                        ParallelSpec(tp=1, pp=1, micro_batch_size=1, global_batch_size=1, seq_length=512),
                        PlanOptions())
    lps = full_policy(prob.stage_contexts(Partition((4,)))[0], g).layers
    new = backward_trace(g, lps, False).peak
    old = backward_trace(g, lps, False, transient=False).peak
    res = g.op("mlp_residual")
    assert res.name == g.output_op and g.op("fc2").out_bytes < res.out_bytes + res.mask_bytes
    assert new - old == res.out_bytes + res.mask_bytes


def test_an_moe_block_hosts_its_backward_window_in_the_combine() -> None:
    """The runtime's engine restores layer l - 1's phase-3 ops inside layer l's combine all-to-all backward (the
    MoE block's first backward collective, at any TP); the replay holds them from there, beside layer l's
    restorations, as the engine does (docs/decisions/0225). A dense block keeps FC1's window (gate_up)."""
    from lynx.models import load_model

    hw = load_hardware("a100-40g-nvlink")
    for tp in (1, 2):
        par = ParallelSpec(tp=tp, dp=2, ep=2, sequence_parallel=tp > 1, micro_batch_size=2, global_batch_size=8,
                           seq_length=32)
        g = make_problem(load_model("moe-tiny"), hw, par, PlanOptions()).graph
        assert _window_op(g, "mlp") == "combine_a2a", tp
    par = ParallelSpec(tp=2, dp=1, micro_batch_size=1, global_batch_size=1, seq_length=32)
    dense = make_problem(load_model("llama-tiny"), hw, par, PlanOptions()).graph
    assert _window_op(dense, "mlp") == "gate_up"  # LLaMA's FC1
    # phase 3 in the combine's window: layer 0's expert ops are held during layer 1's backward
    g = make_problem(load_model("moe-tiny"), hw, ParallelSpec(dp=2, ep=2, micro_batch_size=2, global_batch_size=8,
                                                              seq_length=32), PlanOptions()).graph
    keep = frozenset(o.name for o in g.ops) - {"experts_fc1", "experts_act"}
    on = LayerPolicy(keep=keep, recompute=(("experts_fc1", Phase.BWD_MLP), ("experts_act", Phase.BWD_MLP)))
    late = LayerPolicy(keep=keep, recompute=(("experts_fc1", Phase.ON_DEMAND), ("experts_act", Phase.ON_DEMAND)))
    tr, tr5 = backward_trace(g, (on, on), False), backward_trace(g, (late, late), False)
    both = g.op("experts_fc1").out_bytes + g.op("experts_act").out_bytes
    assert tr.layer_peak[1] == tr5.layer_peak[1] + both, (tr, tr5)
