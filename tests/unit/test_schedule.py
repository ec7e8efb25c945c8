from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lynx.schedule import Action, carrier_of, format_grid, one_f_one_b, parse_action, schedule


def test_action_text_roundtrip() -> None:
    a = Action(2, 0, "F", 0)
    assert str(a) == "2F0"
    assert parse_action("2F0") == a
    with pytest.raises(ValueError, match="not an action"):
        parse_action("2X0")


def test_1f1b_stage0_of_4() -> None:
    acts = [str(a) for a in one_f_one_b(0, 4, 6)]
    assert acts == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4", "0B1", "0F5", "0B2", "0B3", "0B4", "0B5"]


def test_last_stage_alternates() -> None:
    assert [str(a) for a in one_f_one_b(3, 4, 3)] == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2"]


@given(p=st.integers(1, 8), m=st.integers(1, 24))
def test_every_microbatch_once_each_way(p: int, m: int) -> None:
    for s, acts in enumerate(schedule(p, m)):
        assert sorted(a.microbatch for a in acts if a.kind == "F") == list(range(m))
        assert sorted(a.microbatch for a in acts if a.kind == "B") == list(range(m))
        # 1F1B memory bound: never more than p - s forwards outstanding.
        outstanding = 0
        for a in acts:
            outstanding += 1 if a.kind == "F" else -1
            assert 0 <= outstanding <= min(p - s, m)


@given(p=st.integers(2, 8), m=st.integers(1, 24))
def test_carrier_is_the_forward_just_before(p: int, m: int) -> None:
    for s in range(p):
        acts = one_f_one_b(s, p, m)
        car = carrier_of(s, p, m)
        for i, a in enumerate(acts):
            if a.kind == "B" and a.microbatch in car:
                assert acts[i - 1] == Action(s, 0, "F", car[a.microbatch])


def test_grid_marks_error() -> None:
    text = format_grid(schedule(2, 2), error_at=(1, 1))
    assert "<-- ERROR HERE" in text.splitlines()[2]
