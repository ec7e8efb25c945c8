from __future__ import annotations

import itertools

import pytest

from lynx.cost.memory import embedding_params_per_rank, layer_params_per_rank, static_bytes
from lynx.decisions import LayerPolicy, Phase, RecomputePolicy, check_policy, validate_layer_policy
from lynx.errors import PlanFormatError
from lynx.families.gpt import CORE_ATTENTION_OPS
from lynx.models import load_model, total_params
from lynx.partition import dp_partition, even_partition, explicit_partition
from lynx.policy.rules import block_policy, full_layer, keep_all, selective_layer, uniform_policy
from lynx.problem import PlanProblem
from lynx.spec import ParallelSpec, SpecError
from tests.conftest import problem_for


def test_static_memory_is_16_bytes_per_parameter() -> None:
    m = load_model("gpt-7b")
    par = ParallelSpec(tp=1, pp=1)
    assert static_bytes(m, par, 0, m.num_layers) == pytest.approx(16 * total_params(m), rel=1e-9)
    assert static_bytes(m, par, 0, m.num_layers, bytes_per_param=18) == pytest.approx(18 * total_params(m))


def test_embeddings_live_on_first_and_last_stage() -> None:
    m = load_model("gpt-7b")
    par = ParallelSpec(tp=4, pp=4)
    mid = static_bytes(m, par, 1, 8)
    assert static_bytes(m, par, 0, 8) > mid and static_bytes(m, par, 3, 8) > mid
    assert mid == pytest.approx(16 * 8 * layer_params_per_rank(m, 4))


def test_rule_policies_are_valid_and_what_megatron_does(gpt7b_problem: PlanProblem) -> None:
    g = gpt7b_problem.graph
    for lp in (keep_all(g), full_layer(g), selective_layer(g)):
        assert validate_layer_policy(g, lp) == []
    full = full_layer(g)
    assert full.keep == frozenset()
    assert set(full.recomputed()) == set(g.names)  # the whole layer, collectives included
    assert all(p == Phase.ON_DEMAND for _, p in full.recompute)
    sel = selective_layer(g)
    assert set(sel.recomputed()) == CORE_ATTENTION_OPS - {"attn_context"}
    assert {"qkv", "attn_context"} <= sel.keep


def test_invalid_policies_are_explained(gpt7b_problem: PlanProblem) -> None:
    g = gpt7b_problem.graph
    missing = LayerPolicy(keep=keep_all(g).keep - {"gelu"})
    assert any("'gelu' is needed" in e for e in validate_layer_policy(g, missing))
    comm_in_window = LayerPolicy(keep=frozenset(), recompute=tuple((n, Phase.FWD_ATTN) for n in g.names))
    errs = validate_layer_policy(g, comm_in_window)
    assert any("comm op 'attn_allreduce' can only be recomputed on demand" in e for e in errs)
    order = LayerPolicy(
        keep=keep_all(g).keep - {"fc1", "gelu"},
        recompute=(("fc1", Phase.ON_DEMAND), ("gelu", Phase.BWD_MLP)),
    )
    assert any("'gelu' (phase 3) needs 'fc1'" in e for e in validate_layer_policy(g, order))
    last = LayerPolicy(keep=keep_all(g).keep - {"gelu"}, recompute=(("gelu", Phase.FWD_MLP),))
    assert validate_layer_policy(g, last, has_fwd_windows=True) == []
    assert any("no forward windows" in e for e in validate_layer_policy(g, last, has_fwd_windows=False))
    ctx = gpt7b_problem.stage_context(3, 7)
    with pytest.raises(PlanFormatError, match="stage 3 layer 0"):
        check_policy(g, RecomputePolicy("x", (last,) * 7), ctx)


def test_uniform_and_block(gpt7b_problem: PlanProblem) -> None:
    g = gpt7b_problem.graph
    ctx = gpt7b_problem.stage_context(1, 9)
    u = uniform_policy(ctx, g, 3)
    assert [lp.input_checkpoint for lp in u.layers] == [True, False, False] * 3
    check_policy(g, u, ctx)
    b = block_policy(ctx, g, 2)
    assert [bool(lp.recompute) for lp in b.layers] == [True, True] + [False] * 7


def test_policy_dict_roundtrip(gpt7b_problem: PlanProblem) -> None:
    g = gpt7b_problem.graph
    ctx = gpt7b_problem.stage_context(0, 7)
    for pol in (uniform_policy(ctx, g, 2), block_policy(ctx, g, 3)):
        assert RecomputePolicy.from_dict(pol.to_dict(g)) == pol


def _compositions(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every split of n layers into `parts` contiguous non-empty stages."""
    return [tuple(b - a for a, b in zip((0, *cut), (*cut, n), strict=True))
            for cut in itertools.combinations(range(1, n), parts - 1)]


@pytest.mark.parametrize(("model", "tp", "pp"), [("gpt-7b", 4, 4), ("gpt-7b", 1, 3), ("gpt-1.3b", 2, 4),
                                                 ("gpt-13b", 8, 2), ("gpt-tiny", 1, 3)])
def test_dp_partition_is_min_max_optimal(model: str, tp: int, pp: int) -> None:
    """dp's property, not its output: against every contiguous split, no other has a lighter heaviest stage
    (parameters, embeddings on the first and last stage), and among those as light none is more even."""
    m = load_model(model)
    lw, emb = layer_params_per_rank(m, tp), embedding_params_per_rank(m, tp)

    def key(counts: tuple[int, ...]) -> tuple[float, int]:
        w = [n * lw + (emb if s == 0 else 0) + (emb if s == len(counts) - 1 else 0) for s, n in enumerate(counts)]
        return max(w), sum(n * n for n in counts)

    got = dp_partition(m, ParallelSpec(tp=tp, pp=pp)).layers_per_stage
    assert len(got) == pp and sum(got) == m.num_layers and min(got) >= 1
    best = min(key(c) for c in _compositions(m.num_layers, pp))
    assert key(got)[0] == pytest.approx(best[0], rel=1e-12) and key(got)[1] == best[1]


def test_partitions() -> None:
    m = load_model("gpt-7b")
    assert dp_partition(m, ParallelSpec(pp=1)).layers_per_stage == (32,)
    assert even_partition(50, 4).layers_per_stage == (12, 13, 13, 12)
    assert explicit_partition("7,8,8,9", 32, 4).layers_per_stage == (7, 8, 8, 9)
    with pytest.raises(SpecError, match="sums to 31"):
        explicit_partition("7,8,8,8", 32, 4)
    with pytest.raises(SpecError, match="4 entries for PP 2"):
        explicit_partition("7,8,8,9", 32, 2)


def test_block_auto_picks_the_smallest_fitting_n() -> None:
    from lynx.methods import get_method
    from lynx.simulate import simulate

    prob = problem_for(mb=16)
    res = get_method("block").fn(prob)
    n = int(res.notes[0].split()[-1])
    assert 0 < n < 9
    assert not simulate(prob, res.partition, res.policies).oom
