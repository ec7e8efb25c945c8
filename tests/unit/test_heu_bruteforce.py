"""Lynx-HEU finds the optimum that brute force finds, on tiny graphs where every policy can be enumerated.

The brute force knows nothing of the ILP: it enumerates every per-op decision (keep, free, recompute in
phase 1-5), keeps those `validate_layer_policy` accepts and `memory.linear_peak_bytes` fits (the linear
upper bound of `memory.stage_peak_bytes` HEU's rows constrain), and prices them with its own objective (the
stage's critical recomputation per micro-batch, plus the tie-break).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from lynx.cost.memory import linear_peak_bytes, stage_peak_bytes
from lynx.decisions import LayerPolicy, Phase, StageContext, validate_layer_policy
from lynx.errors import InfeasibleError
from lynx.graph import LayerGraph, Op
from lynx.policy.heu import HeuOptions, heu_policy, min_budget_bytes

MiB = float(1 << 20)


def tiny_graph(rng: random.Random) -> LayerGraph:
    """A 7-op layer: attention (mm, comm, dropout-residual) and MLP (mm, act, comm, dropout-residual)."""
    def t() -> float:
        return rng.uniform(0.1, 1.0) * 1e-3

    def b() -> float:
        return rng.choice([1, 2, 4]) * 16 * MiB

    ar1, ar2 = rng.uniform(0.2, 1.2) * 1e-3, rng.uniform(0.2, 1.2) * 1e-3
    ops = (
        Op("a_mm", "compute", "attn", t(), 2 * t(), b(), ("input",), ("input",), wgrad_time=t() / 2),
        Op("a_ar", "comm", "attn", ar1, ar1, 32 * MiB, ("a_mm",), overlaps_wgrad_of="a_mm"),
        Op("a_res", "compute", "attn", t(), t(), 32 * MiB, ("a_ar", "input"), ("a_res",), mask_bytes=16 * MiB),
        Op("m_mm", "compute", "mlp", t(), 2 * t(), b(), ("a_res",), ("a_res",), wgrad_time=t() / 2),
        Op("m_act", "compute", "mlp", t(), t(), b(), ("m_mm",), ("m_mm",)),
        Op("m_ar", "comm", "mlp", ar2, ar2, 32 * MiB, ("m_act",), ("m_act",), overlaps_wgrad_of="m_mm"),
        Op("m_res", "compute", "mlp", t(), t(), 32 * MiB, ("m_ar", "a_res"), ("m_res",), mask_bytes=16 * MiB),
    )
    return LayerGraph(ops, input_bytes=32 * MiB)


def objective(graph: LayerGraph, lp: LayerPolicy, n: int, tie: float) -> float:
    """Independent pricing: n * phase 5 + the top layer's phases 3, 4, (windows never overflow: checked
    separately) + tie * n * all recomputation."""
    c = {o.name: o.fwd_time for o in graph.ops}
    total = 0.0
    for name, ph in lp.recompute:
        w = tie * n + (n if ph == Phase.ON_DEMAND else (1.0 if ph in (Phase.BWD_MLP, Phase.BWD_ATTN) else 0.0))
        total += w * c[name]
    return total


def windows_ok(graph: LayerGraph, lp: LayerPolicy) -> bool:
    cap = {Phase.FWD_ATTN: graph.fwd_window("attn"), Phase.FWD_MLP: graph.fwd_window("mlp"),
           Phase.BWD_MLP: graph.bwd_window("mlp"), Phase.BWD_ATTN: graph.bwd_window("attn")}
    return all(sum(graph.op(n).fwd_time for n in lp.recomputed((ph,))) <= w * (1 + 1e-9) for ph, w in cap.items())


def candidates(graph: LayerGraph, has_fwd: bool) -> Iterator[tuple[str | Phase, ...]]:
    """Every keep/free/phase assignment, pruning a recompute whose input is neither kept nor recomputed
    no later (a prefix that fails this fails validation whatever follows)."""
    choices: list[str | Phase] = ["keep", "free", *Phase]

    def rec(i: int, prefix: tuple[str | Phase, ...]) -> Iterator[tuple[str | Phase, ...]]:
        if i == len(graph.ops):
            yield prefix
            return
        idx = {o.name: k for k, o in enumerate(graph.ops)}
        for c in choices:
            if isinstance(c, Phase):
                if (graph.ops[i].is_comm and c != Phase.ON_DEMAND) or (not has_fwd and c <= Phase.FWD_MLP):
                    continue  # validate_layer_policy rejects these too; pruning only saves time
                deps = [prefix[idx[d]] for d in graph.ops[i].inputs if d != "input"]
                if any(d == "free" or (isinstance(d, Phase) and d > c) for d in deps):
                    continue
            yield from rec(i + 1, (*prefix, c))

    yield from rec(0, ())


def priced_policies(graph: LayerGraph, ctx: StageContext, tie: float) -> list[tuple[float, float]]:
    """(peak bytes, objective) of every valid policy that respects the windows (budget-independent)."""
    out = []
    for combo in candidates(graph, ctx.has_fwd_windows):
        keep = frozenset(o.name for o, c in zip(graph.ops, combo, strict=True) if c == "keep")
        rec = tuple((o.name, c) for o, c in zip(graph.ops, combo, strict=True) if isinstance(c, Phase))
        lp = LayerPolicy(keep, rec)
        if validate_layer_policy(graph, lp, ctx.has_fwd_windows) or not windows_ok(graph, lp):
            continue
        out.append((linear_peak_bytes(graph, (lp,) * ctx.num_layers, ctx), objective(graph, lp, ctx.num_layers, tie)))
    return out


def context(graph: LayerGraph, n: int, in_flight: int, last: bool, frac: float) -> StageContext:
    """A stage whose budget sits `frac` of the way between the least and the most memory it could use."""
    stages = in_flight if last else in_flight + 1
    stage = stages - 1 if last else stages - 1 - in_flight
    base = StageContext(stage, stages, n, in_flight, 8, budget_bytes=1e15, static_bytes=1e9)
    lo = min_budget_bytes(graph, base)
    keep_all = LayerPolicy(graph.needed())
    hi = linear_peak_bytes(graph, (keep_all,) * n, base)
    return StageContext(stage, stages, n, in_flight, 8, budget_bytes=lo + frac * (hi - lo), static_bytes=1e9)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("last", [False, True])
def test_heu_matches_brute_force(seed: int, last: bool) -> None:
    rng = random.Random(seed)
    graph = tiny_graph(rng)
    tie = 1e-3
    priced = priced_policies(graph, context(graph, n=3, in_flight=2, last=last, frac=0.0), tie)
    for frac in (0.05, 0.4, 0.8):
        ctx = context(graph, n=3, in_flight=2, last=last, frac=frac)
        want = min(o for peak, o in priced if peak <= ctx.budget_bytes)
        got = heu_policy(ctx, graph, HeuOptions(tie_break=tie))
        assert got.stats.status == "optimal"
        assert got.stats.objective == pytest.approx(want, rel=1e-6, abs=1e-12), (seed, last, frac)
        # and what HEU returns is itself a policy the brute force accepts
        lp = got.layers[0]
        assert not validate_layer_policy(graph, lp, ctx.has_fwd_windows)
        assert windows_ok(graph, lp)
        assert stage_peak_bytes(graph, got.layers, ctx) <= ctx.budget_bytes * (1 + 1e-9)


def test_min_budget_is_tight() -> None:
    graph = tiny_graph(random.Random(5))
    ctx = context(graph, n=4, in_flight=3, last=False, frac=0.0)
    need = min_budget_bytes(graph, ctx)
    heu_policy(StageContext(**{**_fields(ctx), "budget_bytes": need * (1 + 1e-9)}), graph)
    with pytest.raises(InfeasibleError) as e:
        heu_policy(StageContext(**{**_fields(ctx), "budget_bytes": need - 1 * MiB}), graph)
    assert e.value.min_budget_bytes and e.value.min_budget_bytes[0] == pytest.approx(need, rel=1e-9)
    assert "needs" in str(e.value) and "GiB" in str(e.value)


def _fields(ctx: StageContext) -> dict[str, object]:
    return {k: getattr(ctx, k) for k in StageContext.__dataclass_fields__}


@pytest.mark.parametrize("has_fwd", [False, True])
def test_linear_rows_bound_the_exact_peak_for_every_policy(has_fwd: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every valid policy of the tiny layer, on a stage with and without forward windows: the solvers' linear form
    (`linear_peak_bytes`, HEU's rows, OPT's M5) is at least the lifetime rule's peak, the allocator's view. The
    layer output rebuilt for its dropout mask (`m_res`) is what needs `restored_output_bytes`: without that term
    the linear form falls short of the rule for some policies (the output exists beside the mask it is rebuilt
    for)."""
    import lynx.cost.memory

    graph = tiny_graph(random.Random(3))
    ctx = context(graph, n=3, in_flight=2, last=not has_fwd, frac=0.5)
    assert ctx.has_fwd_windows == has_fwd
    stacks = []
    for combo in candidates(graph, has_fwd):
        keep = frozenset(o.name for o, c in zip(graph.ops, combo, strict=True) if c == "keep")
        rec = tuple((o.name, c) for o, c in zip(graph.ops, combo, strict=True) if isinstance(c, Phase))
        lp = LayerPolicy(keep, rec)
        if not validate_layer_policy(graph, lp, has_fwd):
            stacks.append((lp,) * ctx.num_layers)
    exact = [stage_peak_bytes(graph, layers, ctx) for layers in stacks]
    for layers, e in zip(stacks, exact, strict=True):
        assert e <= linear_peak_bytes(graph, layers, ctx) * (1 + 1e-12), layers[0]
    monkeypatch.setattr(lynx.cost.memory, "restored_output_bytes", lambda *a: 0.0)
    short = sum(e > linear_peak_bytes(graph, layers, ctx) * (1 + 1e-12)
                for layers, e in zip(stacks, exact, strict=True))
    assert len(stacks) > 100 and short > 0
