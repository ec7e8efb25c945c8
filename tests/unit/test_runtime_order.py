"""The schedule the pipeline runtime executes is `lynx.schedule.Schedule` itself: CSV round trip, the runtime's
own checks (layout, F/B only) on top of `lynx.schedule.validate`, and which forward hosts which backward's
phase-1/2 recomputation (the simulator's carrier for 1F1B), all read from lynx.schedule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lynx.runtime.pipeline.order import ActionListError, check_executable, layout_schedule, rank_order, read_schedule
from lynx.schedule import Action, ActionKind, Schedule, carrier_of, save_csv

F, B = ActionKind.F, ActionKind.B


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (3, 3)])
def test_1f1b_hosts_are_the_simulators_carriers(pp: int, m: int) -> None:
    sched = layout_schedule(pp, 1, m)
    check_executable(sched, pp, 1, m)
    for s in range(pp):
        order = rank_order(sched, s)
        got = {j: k for (_, k), (_, j) in order.hosts.items()}
        assert got == carrier_of(s, pp, m)
        # cool-down: unhosted backwards of a stage that has forward windows at all (not the last stage)
        assert order.cooldown == ({(s, j) for j in range(m) if j not in got} if s < pp - 1 else set())
        assert order.in_flight == {s: min(pp - s, m)}


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (2, 3, 4)])
def test_interleaved_hosts_are_the_forward_just_before(pp: int, v: int, m: int) -> None:
    sched = layout_schedule(pp, v, m)
    check_executable(sched, pp, v, m)
    for r, row in enumerate(sched.ranks):
        order = rank_order(sched, r)
        pos = {(a.virtual_stage(pp), a.kind, a.microbatch): i for i, a in enumerate(row)}
        for (s2, k), (s, j) in order.hosts.items():  # the host is the forward just before the backward
            assert pos[(s2, F, k)] + 1 == pos[(s, B, j)]
        assert not order.cooldown & set(order.hosts.values())


def test_csv_round_trip(tmp_path) -> None:
    sched = layout_schedule(2, 2, 4)
    save_csv(sched, tmp_path / "a.csv")
    assert read_schedule(tmp_path / "a.csv").ranks == sched.ranks
    assert (tmp_path / "a.csv").read_text().splitlines()[0].startswith("0F0,0F1,2F0")


def _edit(sched: Schedule, ranks: tuple[tuple[Action, ...], ...]) -> Schedule:
    return replace(sched, ranks=ranks)


@pytest.mark.parametrize("edit,msg", [
    (lambda r: (r[0][:-1], r[1]), "needs one B"),
    (lambda r: (r[0] + (Action(0, 0, F, 0),), r[1]), "is repeated"),
    (lambda r: (r[1], r[0]), "belongs to rank"),
    (lambda r: (r[0],), "PP=2"),
    (lambda r: ((Action(0, 0, B, 0),) + r[0], r[1]), "before its forward"),
    (lambda r: (r[0][:-1] + (Action(0, 0, ActionKind.I, 1), Action(0, 0, ActionKind.W, 1)), r[1]),
     "only F and B are executed"),
])
def test_bad_lists_name_the_problem(edit, msg: str) -> None:
    sched = layout_schedule(2, 1, 2)
    with pytest.raises(ActionListError, match=msg):
        check_executable(_edit(sched, edit(sched.ranks)), 2, 1, 2)


def test_a_schedule_of_another_layout_is_refused() -> None:
    with pytest.raises(ActionListError, match="VPP=1"):
        check_executable(layout_schedule(2, 2, 4), 2, 1, 4)
    with pytest.raises(ActionListError, match="the plan has 8"):
        check_executable(layout_schedule(2, 1, 4), 2, 1, 8)


def test_bad_cell_names_file_and_line(tmp_path) -> None:
    (tmp_path / "a.csv").write_text("0F0,0B0\n1F0,1SEND_F0\n")
    with pytest.raises(ActionListError, match=r"a.csv: rank 1, column 1: .*'1SEND_F0'"):
        read_schedule(tmp_path / "a.csv")
