"""The pipeline action list: CSV round trip, validation, which forward hosts which backward's phase-1/2
recomputation (the simulator's carrier for 1F1B), all read from lynx.schedule."""

from __future__ import annotations

import pytest

from lynx.runtime.pipeline import actions as act
from lynx.schedule import carrier_of


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (3, 3)])
def test_1f1b_hosts_are_the_simulators_carriers(pp: int, m: int) -> None:
    rows = act.schedule_rows(pp, 1, m)
    act.validate(rows, pp, pp, m)
    for s in range(pp):
        host, cool = act.hosts(rows, s)
        got = {j: k for (_, k), (_, j) in host.items()}
        assert got == carrier_of(s, pp, m)
        # cool-down: unhosted backwards of a stage that has forward windows at all (not the last stage)
        assert cool == ({(s, j) for j in range(m) if j not in got} if s < pp - 1 else set())


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (2, 3, 4)])
def test_interleaved_rows_are_valid(pp: int, v: int, m: int) -> None:
    rows = act.schedule_rows(pp, v, m)
    act.validate(rows, pp, pp * v, m)
    for r, row in enumerate(rows):
        host, cool = act.hosts(rows, r)
        pos = {a: i for i, a in enumerate(row)}
        for (s2, k), (s, j) in host.items():  # the host is the forward just before the backward (any chunk)
            assert pos[act.PipeAction(s2, "F", k)] + 1 == pos[act.PipeAction(s, "B", j)]
        assert not cool & {b for b in host.values()}


def test_csv_round_trip(tmp_path) -> None:
    rows = act.schedule_rows(2, 2, 4)
    act.write_csv(rows, tmp_path / "a.csv")
    assert act.read_csv(tmp_path / "a.csv") == rows
    assert (tmp_path / "a.csv").read_text().splitlines()[0].startswith("0F0,0F1,2F0")


@pytest.mark.parametrize("edit,msg", [
    (lambda r: (r[0][:-1], r[1]), "missing 0B1"),
    (lambda r: (r[0] + (act.PipeAction(0, "F", 0),), r[1]), "appears twice"),
    (lambda r: (r[1], r[0]), "lives on rank"),
    (lambda r: (r[0],), "PP=2"),
    (lambda r: ((act.PipeAction(0, "B", 0),) + r[0], r[1]), "before its forward"),
])
def test_bad_lists_name_the_problem(edit, msg: str) -> None:
    with pytest.raises(act.ActionListError, match=msg):
        act.validate(edit(act.schedule_rows(2, 1, 2)), 2, 2, 2)


def test_bad_cell_names_file_and_line(tmp_path) -> None:
    (tmp_path / "a.csv").write_text("0F0,0B0\n1F0,1SEND_F0\n")
    with pytest.raises(act.ActionListError, match=r"a.csv: rank 1, column 1: .*'1SEND_F0'"):
        act.read_csv(tmp_path / "a.csv")
