"""The schedule package: generators, validation with a grid, the text and CSV forms, and the facts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lynx.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    derive_facts,
    dumps,
    loads,
    make_schedule,
    parse_action,
    schedule_1f1b,
    schedule_gpipe,
    schedule_interleaved,
    validate,
    warmup_count,
)

F, B = ActionKind.F, ActionKind.B


@given(p=st.integers(1, 6), m=st.integers(1, 16))
def test_1f1b_and_gpipe_validate(p: int, m: int) -> None:
    validate(schedule_1f1b(p, m))
    validate(schedule_gpipe(p, m))


@given(p=st.integers(2, 5), groups=st.integers(1, 4), v=st.integers(2, 4))
def test_interleaved_validates_and_runs_every_chunk(p: int, groups: int, v: int) -> None:
    s = validate(schedule_interleaved(p, p * groups, v))
    for r, acts in enumerate(s):
        assert len(acts) == 2 * v * p * groups
        assert {(a.chunk, a.kind) for a in acts} == {(c, k) for c in range(v) for k in (F, B)}
        assert all(a.stage == r for a in acts)


def test_interleaved_megatron_order_rank0() -> None:
    """Micro-batch groups of pp: chunk 0 runs micro-batches 0..3, then chunk 1 runs them, then chunk 0 4..7."""
    acts = schedule_interleaved(4, 8, 2)[0]
    assert [a.text(4) for a in acts[:9]] == ["0F0", "0F1", "0F2", "0F3", "4F0", "4F1", "4F2", "4F3", "0F4"]
    # Megatron's warm-up on rank 0: 2 (pp - 1) + (v - 1) pp = 10 forwards, then 1F1B with the last chunk's B
    assert acts[10].kind is F and acts[11] == Action(0, 1, B, 0)
    # all warm-up when there are exactly pp micro-batches
    only = schedule_interleaved(4, 4, 2)[0]
    assert all(a.kind is F for a in only[:8]) and all(a.kind is B for a in only[8:])


def test_interleaved_requires_a_multiple_of_pp() -> None:
    with pytest.raises(ScheduleError, match="multiple of pp"):
        schedule_interleaved(4, 6, 2)
    with pytest.raises(ScheduleError, match="at least 2 chunks"):
        schedule_interleaved(4, 8, 1)


def test_text_form() -> None:
    a = Action(1, 1, B, 3)
    assert a.text(4) == "5B3" and parse_action("5B3", pp=4) == a
    assert str(Action(2, 0, F, 0)) == "2F0" and parse_action("2F0") == Action(2, 0, "F", 0)
    with pytest.raises(ScheduleError, match="not an action"):
        parse_action("2UNSHARD")


def _swap(s: Schedule, rank: int, i: int, k: int) -> Schedule:
    acts = list(s[rank])
    acts[i], acts[k] = acts[k], acts[i]
    return Schedule(tuple(tuple(acts) if r == rank else a for r, a in enumerate(s)), s.num_chunks)


def test_validation_errors_carry_the_grid() -> None:
    s = schedule_1f1b(2, 2)
    with pytest.raises(ScheduleError, match="before its forward") as e:
        validate(_swap(s, 1, 0, 1))  # rank 1 (last): B0 before F0
    assert "<-- ERROR HERE" in str(e.value)
    missing = Schedule((s[0], s[1][:-1]))
    with pytest.raises(ScheduleError, match="needs one B"):
        validate(missing)
    repeated = Schedule((s[0] + (s[0][0],), s[1]))
    with pytest.raises(ScheduleError, match="repeated"):
        validate(repeated)
    # Rank 0 runs B0 before F1; rank 1 runs F1 before B0: each waits on the other.
    r0 = (Action(0, 0, F, 0), Action(0, 0, B, 0), Action(0, 0, F, 1), Action(0, 0, B, 1))
    r1 = (Action(1, 0, F, 0), Action(1, 0, F, 1), Action(1, 0, B, 1), Action(1, 0, B, 0))
    with pytest.raises(ScheduleError, match="deadlock") as e:
        validate(Schedule((r0, r1)))
    assert "<-- ERROR HERE" in str(e.value)


@given(p=st.integers(1, 4), m=st.integers(1, 8), v=st.sampled_from([1, 2, 3]))
def test_csv_roundtrip(p: int, m: int, v: int) -> None:
    if v > 1 and (p < 2 or m % p):
        return
    s = make_schedule(p, m, v)
    back = loads(dumps(s))
    assert back.ranks == s.ranks and back.num_chunks == s.num_chunks


def test_csv_errors_name_the_cell() -> None:
    with pytest.raises(ScheduleError, match="rank 1, column 0"):
        loads("0F0,0B0\n1X0,1B0\n")
    with pytest.raises(ScheduleError, match="puts on rank 0"):
        loads("0F0,0B0\n0F1,1B0\n")
    assert loads("0F0,,0B0\n1F0,1B0,\n").ranks[0] == (Action(0, 0, F, 0), Action(0, 0, B, 0))


@given(p=st.integers(1, 6), m=st.integers(1, 16))
def test_facts_of_1f1b(p: int, m: int) -> None:
    """The facts restate what 1F1B implies: min(p - s, m) in flight; the forward before each steady backward
    hosts it; the last stage has no forward windows."""
    f = derive_facts(schedule_1f1b(p, m))
    for s in range(p):
        c = f.of(s)
        assert c.in_flight == min(p - s, m)
        assert c.has_fwd_windows == (s < p - 1 and m > 1)
        for j, (_, host) in c.hosts:
            assert host > j
        if s < p - 1 and m > p - s - 1:
            assert c.cooldown_count == warmup_count(s, p, m)


def test_interleaved_facts_first_rank_holds_more() -> None:
    f = derive_facts(schedule_interleaved(4, 8, 2))
    totals = [sum(c.in_flight for c in f.chunks[r]) for r in range(4)]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]
    # a forward of another chunk can run between F(j) and B(j): rank 0 chunk 0, micro-batch 0
    assert any(ch == 1 for ch, _ in f.of(0, 0).between[0])
    assert not f.of(3, 1).has_fwd_windows  # the last virtual stage alternates F(j) B(j)


def test_live_vectors_bound_every_step() -> None:
    """The Pareto-maximal in-flight vectors dominate the live counts at every step of the rank's list."""
    s = schedule_interleaved(4, 8, 2)
    f = derive_facts(s)
    assert f.live[0] == ((7, 4), (8, 3))  # never 8 of chunk 0 and 4 of chunk 1 at once
    for r, acts in enumerate(s):
        count = [0, 0]
        for a in acts:
            count[a.chunk] += 1 if a.kind is F else -1
            assert any(all(v >= c for v, c in zip(vec, count, strict=True)) for vec in f.live[r])
    assert derive_facts(schedule_1f1b(4, 8)).live == (((4,),), ((3,),), ((2,),), ((1,),))


@pytest.mark.parametrize(("pp", "m", "v"), [(4, 12, 3), (2, 6, 5), (3, 9, 4), (8, 16, 2)])
def test_live_vectors_are_exactly_the_maximal_counts(pp: int, m: int, v: int) -> None:
    """Every rank's live vectors are the counts reached after some forward that no other reached count
    dominates: checked pairwise (quadratic, as written by hand) over every forward's count, on several chunks."""
    s = schedule_interleaved(pp, m, v)
    f = derive_facts(s)
    for r, acts in enumerate(s):
        count, seen = [0] * v, set()
        for a in acts:
            count[a.chunk] += 1 if a.kind is F else -1
            if a.kind is F:
                seen.add(tuple(count))
        maximal = {x for x in seen if not any(y != x and all(b >= c for b, c in zip(y, x, strict=True))
                                             for y in seen)}
        assert f.live[r] == tuple(sorted(maximal))
        assert len(maximal) > 1 or r == pp - 1
